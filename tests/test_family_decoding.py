"""Our cached decoding loop against SDAR's and LLaDA2's own published loops, token for token and step by step.

The references (benchmarks/families.py, one copy, loaded here with runpy) are greedy, full-recompute rewrites
of JetAstra/SDAR generate.py `block_diffusion_generate` and of inclusionAI LLaDA2.0's
modeling_llada2_moe.py `LLaDA2MoeModelLM.generate`, calling only `engine.model(ids, block_size=B)` on the
whole sequence every step. `engine.generate` / `engine.stream` (runtime/generation.py `denoise`,
`select_positions`) must write the same positions with the same tokens at every step, on tiny random sdar,
sdar_moe and llada2 models, for fresh random prompts of ragged lengths.

Where the rules agree, and where they do not:

* Grid and prompt: both put the grid at position 0, prefill the prompt's whole blocks and decode its partial
  block first with the prompt tail kept. The published loops decode the last block whole (`num_blocks =
  ceil((P + gen_length) / B)`, positions past gen_length included, which the block's other positions attend
  to); ours ends the last block at max_new_tokens. So prompt + new tokens end on the grid here; a ragged end
  is decoded differently by design.
* Fixed number per step (our `fixed`, SDAR `low_confidence_static`, LLaDA2 with a threshold nothing passes):
  the same schedule (B // steps, remainder first) and the top-k confidences. SDAR's generate.py does not
  clip k to the masked positions left: in a prompt's partial block whose masks are not a prefix sum of the
  schedule (B=4, 2 steps, 1 or 3 masks) `torch.topk` also picks a non-masked (-inf) position and overwrites
  it with the model's argmax there, a prompt token or one committed earlier; ours (and LLaDA2, `min(k,
  masked)`) clip. `test_sdar_static_writes_an_unmasked_position` shows it; the equality tests use prompt
  lengths where it cannot happen.
* Threshold: ours commits every masked position with confidence > threshold, else the single most confident
  one. SDAR's `low_confidence_dynamic` and LLaDA2's rule commit those above the threshold only when there are
  at least `num_transfer_tokens[step]` of them, else the top `num_transfer_tokens[step]`: the same rule when
  steps == block size (one token per step in the schedule: SDAR's CLI default 4/4, LLaDA2's 32/32), tested
  here; with fewer steps theirs commits at least B / steps per step and ours at least one. Ties: strict `>`
  in all three; the fallback is argmax / topk(1), equal barring exactly equal confidences.
* LLaDA2 caps `steps = min(steps, gen_length // minimal_topk)`: for gen_length < 32 it commits more than
  one token per step even at steps=32; ours has no such cap (here gen_length >= 32).
* Confidence: the chosen token's probability. Ours leaves the mask token out of the softmax (never chosen,
  the others renormalised); the published loops keep it. The models here zero the mask token's lm_head row,
  so its probability is under 1e-4, as a trained model's is (write_model).
* EOS: ours stops at the step that makes the committed prefix reach an EOS, returning the tokens before it.
  SDAR finishes the block and stops after it; LLaDA2 returns at a step that committed EOS with no mask
  before the first EOS (`eos_early_stop`), else after the block. The tokens before the first EOS are the
  same; ours may take fewer forwards, never more. (LLaDA2 looks for the first EOS in the prompt too: an EOS
  in the prompt would cut its output inside the prompt; the prompts here hold none.)
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

BENCH = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "families.py"), run_name="bench")
FAMILY_BLOCK = BENCH["FAMILY_BLOCK"]
greedy_pick = BENCH["greedy_pick"]
num_transfer_tokens = BENCH["num_transfer_tokens"]
run_reference = BENCH["run_reference"]
KINDS = ("sdar", "sdar_moe", "llada2")
PROMPT_LENGTHS = {"sdar": (5, 8, 10, 14, 19), "sdar_moe": (6, 9, 12, 15), "llada2": (7, 32, 45)}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {kind: BENCH["load"](BENCH["write_model"](root / kind, kind, seed=11 + i, num_hidden_layers=2))
            for i, kind in enumerate(KINDS)}


def _prompt(seed: int, n: int) -> list[int]:
    """Random byte tokens (the families' specials, EOS and mask among them, are all >= 256)."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _new_tokens(P: int, B: int, whole_blocks: int) -> int:
    """Generated tokens that finish the prompt's partial block and `whole_blocks` more: ending on the grid."""
    return (-P) % B + whole_blocks * B


def _ours(engine, prompt, n, B, rule, steps, threshold, eos=False):
    """Our loop through engine.stream: the Generation and each step's (positions, tokens)."""
    trace, done = [], None
    for ev in engine.stream(list(prompt), max_new_tokens=n, block_size=B, policy=rule, steps_per_block=steps,
                            threshold=threshold, ignore_eos=not eos):
        if ev.kind == "step":
            trace.append((list(ev.committed), list(ev.tokens)))
        elif ev.kind == "done":
            done = ev.generation
    return done, trace


def _static_overflows(P: int, B: int, steps: int) -> bool:
    """Whether SDAR's unclipped topk overruns the prompt's partial block (its masks no prefix sum)."""
    masks = B - P % B
    sums, total = set(), 0
    for k in num_transfer_tokens(B, steps):
        total += k
        sums.add(total)
    return masks not in sums


def _threshold(engine, prompt, B) -> float:
    """A threshold inside the confidences the model shows for this prompt (first decoded block and the next,
    all masked), at the middle of their widest gap: some positions pass, some do not, none is near it."""
    P = len(prompt)
    end = (P // B + 2) * B
    ids = torch.tensor([list(prompt) + [engine.mask_token_id] * (end - P)])
    _, conf = greedy_pick(engine.model(ids, block_size=B)[0, P:])
    c = sorted(conf.tolist())
    lo, hi = len(c) // 4, max(len(c) // 4 + 1, 3 * len(c) // 4)
    gaps = [(c[i + 1] - c[i], i) for i in range(lo, min(hi, len(c) - 1))]
    gap, i = max(gaps)
    assert gap > 1e-3, f"confidences too close to place a threshold: {c}"
    return (c[i] + c[i + 1]) / 2


@pytest.mark.parametrize("kind", KINDS)
def test_fixed_rule_matches_published_loop(engines, kind):
    """Our `fixed` policy = SDAR's low_confidence_static / LLaDA2's top-k schedule, at every step: the same
    positions get the same tokens, the same forwards, on ragged prompts, at several steps per block."""
    engine, B = engines[kind], FAMILY_BLOCK[kind]
    step_counts = (B, B // 2, 1) if B == 4 else (B, B // 4)
    checked = 0
    for j, P in enumerate(PROMPT_LENGTHS[kind]):
        prompt = _prompt(100 * j + 1, P)
        n = _new_tokens(P, B, 2 if B == 4 else 1)
        for steps in step_counts:
            if kind != "llada2" and P % B and _static_overflows(P, B, steps):
                continue  # SDAR overwrites an unmasked position there (module docstring)
            ref_trace: list = []
            ref, ref_forwards = run_reference(kind, engine, prompt, n, B, "fixed", steps, 0.9, trace=ref_trace)
            ours, trace = _ours(engine, prompt, n, B, "fixed", steps, 0.9)
            assert trace == ref_trace, (kind, P, steps)
            assert ours.token_ids == ref and len(ref) == n
            assert ours.stats.forwards == ref_forwards == len(ref_trace)
            assert max(len(pos) for pos, _ in ref_trace) == -(-B // steps)  # the schedule was exercised
            checked += 1
    assert checked > len(PROMPT_LENGTHS[kind])  # every prompt at steps = B, some at fewer


@pytest.mark.parametrize("kind", KINDS)
def test_threshold_rule_matches_published_loop(engines, kind):
    """Our `threshold` policy = SDAR's low_confidence_dynamic and LLaDA2's threshold rule at steps = block
    size, with a threshold taken from the model's own confidences, so steps commit several tokens, and others
    fall back to the single most confident one."""
    engine, B = engines[kind], FAMILY_BLOCK[kind]
    multi = single = 0
    for j, P in enumerate(PROMPT_LENGTHS[kind]):
        prompt = _prompt(100 * j + 2, P)
        n = _new_tokens(P, B, 2)
        thr = _threshold(engine, prompt, B)
        ref_trace: list = []
        ref, ref_forwards = run_reference(kind, engine, prompt, n, B, "threshold", B, thr, trace=ref_trace)
        ours, trace = _ours(engine, prompt, n, B, "threshold", B, thr)
        assert trace == ref_trace, (kind, P, thr)
        assert ours.token_ids == ref and len(ref) == n
        assert ours.stats.forwards == ref_forwards
        multi += sum(len(pos) > 1 for pos, _ in trace)
        single += sum(len(pos) == 1 for pos, _ in trace)
    assert multi and single, (multi, single)  # both branches of the rule were taken


def _eos_candidate(tokens: list[int], prompt: list[int], B: int) -> tuple[int, int] | None:
    """A token the model emits for the first time after the first decoded block, not in the block's last
    position (so the block goes on after it) and not in the prompt: (token, index in the generated part)."""
    P = len(prompt)
    first: dict[int, int] = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    ok = [(i, t) for t, i in first.items()
          if t not in prompt and i >= (-P) % B and (P + i) % B != B - 1 and i < len(tokens) - 1]
    return (max(ok)[1], max(ok)[0]) if ok else None


@pytest.mark.parametrize("kind", KINDS)
def test_eos_early_stop_matches_published_loop(engines, kind):
    """With EOS set to a token greedy decoding emits mid-way, ours and the family's loop (SDAR's
    stopping_criteria_idx, LLaDA2's eos_early_stop) return the same tokens, the ones before it; ours stops at
    or before the reference's step, and neither decodes a block after the EOS."""
    engine, B = engines[kind], FAMILY_BLOCK[kind]
    saved = list(engine.eos_token_ids)
    checked = 0
    try:
        for j in range(12):
            P = PROMPT_LENGTHS[kind][j % len(PROMPT_LENGTHS[kind])]
            prompt = _prompt(100 * j + 3, P)
            n = _new_tokens(P, B, 3 if B == 4 else 2)
            thr = _threshold(engine, prompt, B)
            full, _ = run_reference(kind, engine, prompt, n, B, "threshold", B, thr)
            pick = _eos_candidate(full, prompt, B)
            if pick is None:
                continue
            eos, i = pick
            engine.eos_token_ids = [eos]
            ref_trace: list = []
            ref, ref_forwards = run_reference(kind, engine, prompt, n, B, "threshold", B, thr, eos_id=eos,
                                              trace=ref_trace)
            ours, trace = _ours(engine, prompt, n, B, "threshold", B, thr, eos=True)
            assert ours.finish_reason == "eos"
            assert ours.token_ids == ref == full[:i]
            assert ours.stats.forwards <= ref_forwards
            # (No step-by-step trace here: one of these runs meets two positions predicting the same token with
            # confidences 3.6e-7 apart, where cached and full-recompute float sums may pick either.)
            eos_block_end = (P + i) // B * B + B
            assert max(p for pos, _ in ref_trace for p in pos) < eos_block_end  # the reference stopped there too
            assert max(p for pos, _ in trace for p in pos) < eos_block_end
            checked += 1
            if checked == 3:
                break
    finally:
        engine.eos_token_ids = saved
    assert checked, "no prompt made the model emit a usable EOS candidate"


def test_sdar_static_writes_an_unmasked_position(engines):
    """The difference the module docstring describes: SDAR generate.py's low_confidence_static with B=4, 2
    steps (schedule 2, 2) and a prompt ending 3 tokens into a block (1 mask) writes 2 positions in that
    block's first step, one of them not masked; ours commits the 1 masked position."""
    engine, B = engines["sdar"], 4
    prompt = _prompt(7, 11)
    ref_trace: list = []
    run_reference("sdar", engine, prompt, 5, B, "fixed", 2, 0.9, trace=ref_trace)
    ours, trace = _ours(engine, prompt, 5, B, "fixed", 2, 0.9)
    assert trace[0][0] == [11]
    assert len(ref_trace[0][0]) == 2 and 11 in ref_trace[0][0] and min(ref_trace[0][0]) < 11


def test_families_benchmark_runs_small(tmp_path):
    """benchmarks/families.py end to end at toy sizes: tokens identical to each reference, sane INT4 rows."""
    out = tmp_path / "families.json"
    assert BENCH["main"](["--hidden", "64", "--layers", "2", "--prompt-len", "24", "--new-tokens", "40",
                          "--rules", "threshold", "fixed", "--threshold", "0.3", "--eval-seqs", "2",
                          "--eval-len", "32", "--nsamples", "4", "--seqlen", "32", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["family"], r["rule"]) for r in data["races"]] == [(k, r) for k in KINDS for r in ("threshold", "fixed")]
    assert all(r["identical_tokens"] and r["ours_forwards"] > 0 and r["speedup"] > 0 for r in data["races"])
    assert [q["family"] for q in data["quant"]] == list(KINDS)
    for q in data["quant"]:
        assert 0 < q["kl"] < 1 and 0.3 < q["top1_agreement"] <= 1 and q["positions"] == 64
        assert q["mib_int4"] < q["mib_16bit"]
