"""DiffusionGemma's quality against a reference on held-out text, the way its denoiser is used.

Each evaluation window's first tokens are the committed text, encoded into a prefix cache; its last
`canvas_length` tokens are a canvas of which a share (cycling through `noise_ratios`) is replaced by uniform
random tokens, the noise its sampler starts from and renoises with. One decoder pass without
self-conditioning (a canvas's first step) scores the true tokens at the renoised positions: their NLL, and
against a reference KL(reference || model) and top-1 agreement. The block denoisers' masked-token version
is quant/eval.py; both report an EvalResult.
"""

from __future__ import annotations

import math

import torch

from clover_lite.errors import CloverError
from clover_lite.quant.eval import EvalResult, check_same_tokenizer, heldout_windows
from clover_lite.runtime.device import on_device
from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine


def check_window(canvas: int, context: int, seqlen: int) -> None:
    """A window holds at least one committed token before its canvas, and fits the model's context."""
    C, limit = canvas, context
    if not C < seqlen <= limit:
        raise CloverError(f"--seqlen {seqlen}: a DiffusionGemma window is committed text then a canvas of {C} "
                          f"tokens, so it takes {C + 1} to {limit} (the model's context) tokens")


def canvas_windows(engine: DiffusionGemmaEngine, text_file: str | None, nsamples: int, seqlen: int, seed: int,
                   noise_ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the windows' true tokens [n, seqlen], their canvases with the noise in [n, C], which canvas positions
    were renoised [n, C]); the same for every model with this tokenizer, canvas length and `seed`."""
    if engine.tokenizer is None:
        raise CloverError("evaluation needs the model's tokenizer (tokenizer.json or tokenizer.model)")
    eos = engine.settings.eos_token_ids
    gen = torch.Generator().manual_seed(seed)
    ids = heldout_windows(engine.tokenizer, text_file, eos[0] if eos else None, nsamples, seqlen, gen)
    C, V = engine.canvas_length, engine.model.config.vocab_size
    noised = torch.zeros(nsamples, C, dtype=torch.bool)
    for i in range(nsamples):
        k = max(1, round(noise_ratios[i % len(noise_ratios)] * C))
        noised[i, torch.randperm(C, generator=gen)[:k]] = True
    noise = torch.randint(0, V, (nsamples, C), generator=gen)
    return ids, torch.where(noised, noise, ids[:, -C:]), noised


def _log_probs(engine: DiffusionGemmaEngine, prefix: torch.Tensor, canvas: torch.Tensor,
               noised: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities [k, vocab] (on the CPU) at one window's renoised canvas positions."""
    model = engine.model
    device = model.decoder.embed_tokens.weight.device
    with on_device(device):
        cache = model.new_cache()
        model.encode(prefix[None].to(device), cache)
        logits = model.denoise(canvas[None].to(device), cache)[0]
    return logits[noised.to(device)].float().log_softmax(-1).cpu()


def _check_comparable(engine: DiffusionGemmaEngine, reference: DiffusionGemmaEngine) -> None:
    """As quant/eval.py's: KL and agreement measure what quantization changed, so the two must be the same
    architecture with the same vocabulary, canvas and tokenizer."""
    ours, theirs = engine.model.config, reference.model.config
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts", "vocab_size")
    differ = [f"{k} {getattr(ours, k)} vs {getattr(theirs, k)}" for k in shape
              if getattr(ours, k) != getattr(theirs, k)]
    if engine.canvas_length != reference.canvas_length:
        differ.append(f"canvas_length {engine.canvas_length} vs {reference.canvas_length}")
    if differ:
        raise CloverError(f"the model and --against are different models ({', '.join(differ)}); compare a model "
                          "with the checkpoint it was quantized from")
    check_same_tokenizer(engine.tokenizer, reference.tokenizer)


@torch.no_grad()
def evaluate_diffusion_gemma(engine: DiffusionGemmaEngine, reference: DiffusionGemmaEngine | None = None,
                             text_file: str | None = None, nsamples: int = 64, seqlen: int = 256, seed: int = 0,
                             noise_ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)) -> EvalResult:
    if nsamples < 1:
        raise CloverError(f"--nsamples ({nsamples}) must be at least 1")
    check_window(engine.canvas_length, engine.context_limit, seqlen)
    if reference is not None:
        _check_comparable(engine, reference)
        check_window(reference.canvas_length, reference.context_limit, seqlen)
    ids, canvases, noised = canvas_windows(engine, text_file, nsamples, seqlen, seed, noise_ratios)
    C = canvases.shape[-1]
    nll = ref_nll = kl = agree = 0.0
    for i in range(nsamples):
        prefix, target = ids[i, :-C], ids[i, -C:][noised[i]]
        logp = _log_probs(engine, prefix, canvases[i], noised[i])
        nll -= logp.gather(-1, target[:, None]).sum().item()
        if reference is not None:
            ref = _log_probs(reference, prefix, canvases[i], noised[i])
            ref_nll -= ref.gather(-1, target[:, None]).sum().item()
            kl += (ref.exp() * (ref - logp)).sum().item()
            agree += (ref.argmax(-1) == logp.argmax(-1)).sum().item()
    if not math.isfinite(nll):
        raise CloverError("the model produced non-finite log-probabilities on the evaluation text")
    n, has_ref = int(noised.sum()), reference is not None
    return EvalResult(nll=nll / n, ref_nll=ref_nll / n if has_ref else None, kl=kl / n if has_ref else None,
                      top1_agreement=agree / n if has_ref else None, positions=n)
