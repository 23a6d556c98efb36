"""`clover eval` on DiffusionGemma: renoised-canvas NLL, KL and top-1 agreement against transformers 5.24's
DiffusionGemma (which nobody here wrote) run on the same windows, the windows themselves checked against
their definition, and the command's errors. Seeds and window lengths are fresh per run (tests/seed.py)."""

import random

import pytest
import torch
from click.testing import CliRunner

import clover_lite
from clover_lite.checkpoint.tiny_diffusion_gemma import write_tiny_diffusion_gemma
from clover_lite.cli.main import main as cli
from clover_lite.errors import CloverError
from clover_lite.quant.diffusion_gemma import quantize_diffusion_gemma
from clover_lite.quant.eval_diffusion_gemma import canvas_windows, evaluate_diffusion_gemma
from clover_lite.quant.pipeline import QuantizeOptions

from .seed import SEED

pytest.importorskip("transformers.models.diffusion_gemma")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two tiny DiffusionGemma checkpoints of one architecture and tokenizer, different weights (the window
    of sliding layers shorter than the windows evaluated)."""
    root = tmp_path_factory.mktemp("dgeval")
    kw = dict(sliding_window=12, max_position_embeddings=96)
    return (write_tiny_diffusion_gemma(root / "a", seed=SEED % 1000, **kw),
            write_tiny_diffusion_gemma(root / "b", seed=SEED % 1000 + 1, **kw))


def hf_log_probs(hf, prefix: torch.Tensor, canvas: torch.Tensor, noised: torch.Tensor) -> torch.Tensor:
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    hf.model.encoder(input_ids=prefix[None], cache=cache)
    return hf(decoder_input_ids=canvas[None], cache=cache).logits[0][noised].double().log_softmax(-1)


def test_nll_kl_and_agreement_match_transformers(pair):
    """On the evaluator's own windows, each model's renoised-token NLL, KL(reference || model) and top-1
    agreement recomputed in float64 from transformers' logits."""
    from transformers import DiffusionGemmaForBlockDiffusion

    rng = random.Random(SEED)
    nsamples, seqlen, seed = rng.randint(3, 7), rng.randint(9, 40), rng.randrange(1 << 20)
    a, b = (clover_lite.load(p, device="cpu") for p in pair)
    got = evaluate_diffusion_gemma(a, b, nsamples=nsamples, seqlen=seqlen, seed=seed)
    hf_a, hf_b = (DiffusionGemmaForBlockDiffusion.from_pretrained(p).eval() for p in pair)
    ids, canvases, noised = canvas_windows(a, None, nsamples, seqlen, seed)
    C = canvases.shape[1]
    nll = ref_nll = kl = agree = 0.0
    with torch.no_grad():
        for i in range(nsamples):
            target = ids[i, -C:][noised[i]]
            lp = hf_log_probs(hf_a, ids[i, :-C], canvases[i], noised[i])
            ref = hf_log_probs(hf_b, ids[i, :-C], canvases[i], noised[i])
            nll -= lp.gather(-1, target[:, None]).sum().item()
            ref_nll -= ref.gather(-1, target[:, None]).sum().item()
            kl += (ref.exp() * (ref - lp)).sum().item()
            agree += (ref.argmax(-1) == lp.argmax(-1)).sum().item()
    n = int(noised.sum())
    assert got.positions == n
    assert got.nll == pytest.approx(nll / n, rel=1e-4) and got.ref_nll == pytest.approx(ref_nll / n, rel=1e-4)
    assert got.kl == pytest.approx(kl / n, rel=1e-3, abs=1e-6), (SEED, got, kl / n)
    assert got.top1_agreement == pytest.approx(agree / n)
    same = evaluate_diffusion_gemma(a, a, nsamples=2, seqlen=seqlen, seed=seed)
    assert same.kl == pytest.approx(0, abs=1e-6) and same.top1_agreement == 1 and same.nll == same.ref_nll


def test_windows_follow_their_definition(pair):
    """Each window is a slice of the held-out token stream; its canvas holds the window's last C tokens with
    round(ratio * C) of them (at least one) renoised, the ratio cycling; the noise is uniform over the
    vocabulary, so over many windows it is not the true tokens."""
    engine = clover_lite.load(pair[0], device="cpu")
    rng = random.Random(SEED + 1)
    n, seqlen = 12, rng.randint(9, 60)
    # The first ratio rounds up (3.6 or 5.6 positions of 8), so rounding, not truncation, is checked.
    ratios = (rng.choice([0.45, 0.7]), *(rng.choice([0.1, 0.3, 0.45, 0.7, 1.0]) for _ in range(rng.randint(0, 2))))
    ids, canvases, noised = canvas_windows(engine, None, n, seqlen, SEED, ratios)
    C = engine.model.config.canvas_length
    assert ids.shape == (n, seqlen) and canvases.shape == noised.shape == (n, C)
    for i in range(n):
        assert int(noised[i].sum()) == max(1, round(ratios[i % len(ratios)] * C))
        assert torch.equal(canvases[i][~noised[i]], ids[i, -C:][~noised[i]])
    changed = (canvases != ids[:, -C:])[noised].float().mean()
    assert changed > 0.9  # uniform noise over 265 tokens hits the true one ~0.4% of the time
    again = canvas_windows(clover_lite.load(pair[1], device="cpu"), None, n, seqlen, SEED, ratios)
    assert all(torch.equal(x, y) for x, y in zip((ids, canvases, noised), again, strict=True))


def test_clover_eval_on_a_quantized_diffusion_gemma(pair, tmp_path):
    """`clover eval QUANT --against SRC`: the command's table holds the API's numbers for an RTN model."""
    out = tmp_path / "rtn"
    quantize_diffusion_gemma(pair[0], out, QuantizeOptions(group_size=32, nsamples=4, seqlen=32, method="rtn"))
    want = evaluate_diffusion_gemma(clover_lite.load(out, device="cpu"), clover_lite.load(pair[0], device="cpu"),
                                    nsamples=4, seqlen=24, seed=3)
    assert 0 < want.kl < 1, want
    r = CliRunner().invoke(cli, ["eval", str(out), "--against", str(pair[0]), "--nsamples", "4", "--seqlen", "24",
                                 "--seed", "3"])
    assert r.exit_code == 0, r.output
    assert "renoised-token" in r.output
    assert f"{want.nll:.4f}" in r.output and f"{want.kl:.5f}" in r.output and f"{want.top1_agreement:.3f}" in r.output


def test_errors_name_the_problem(pair, tmp_path):
    engine = clover_lite.load(pair[0], device="cpu")
    with pytest.raises(CloverError, match="takes 9 to 96"):
        evaluate_diffusion_gemma(engine, seqlen=8)
    other = write_tiny_diffusion_gemma(tmp_path / "wide", seed=1, hidden_size=48)
    with pytest.raises(CloverError, match="different models .*hidden_size"):
        evaluate_diffusion_gemma(engine, clover_lite.load(other, device="cpu"), nsamples=1, seqlen=20)
    other = clover_lite.load(pair[1], device="cpu")
    other.tokenizer.encode = lambda text, **kw: [t + 1 for t in engine.tokenizer.encode(text, **kw)]
    with pytest.raises(CloverError, match="tokenize text differently"):
        evaluate_diffusion_gemma(engine, other, nsamples=1, seqlen=20)
    for args, words in ((["eval", str(pair[0]), "--seqlen", "97"], "takes 9 to 96"),
                        (["eval", str(pair[0]), "--against", str(clover_lite.__path__[0]) + "/data/clover-tiny"],
                         "is a DiffusionGemma checkpoint and the other is not")):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 1 and words in r.output, r.output
