"""Quality of a (quantized) model against a reference on held-out text, the way a denoiser is used.

Each evaluation window ends with a block masked at a ratio cycling through `mask_ratios`; both models
run the reference block-causal forward, and on the masked positions we report the masked-token NLL of
the true tokens under each model and KL(reference || model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from clover_lite.errors import CloverError
from clover_lite.models.config import ModelConfig
from clover_lite.quant.calibration import heldout_texts, read_calibration_file, token_stream
from clover_lite.runtime.engine import Engine, on_device
from clover_lite.tokenizer.tokenizer import Tokenizer


@dataclass
class EvalResult:
    nll: float  # mean masked-token NLL of the model (nats)
    ref_nll: float | None  # the same for the reference
    kl: float | None  # mean KL(reference || model) per masked position (nats)
    top1_agreement: float | None  # share of masked positions where both models' argmax agree
    positions: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def check_window(config: ModelConfig, seqlen: int) -> None:
    """An evaluation window is one forward over `seqlen` positions: past the model's context it is out of the
    model's range, and its attention would ask for memory by the square of its length, so it is refused."""
    if seqlen > config.max_position_embeddings:
        raise CloverError(f"--seqlen {seqlen} is longer than the model's context (max_position_embeddings "
                          f"{config.max_position_embeddings}); use --seqlen {config.max_position_embeddings} or less")


def heldout_windows(tokenizer: Tokenizer, text_file: str | None, separator: int | None, nsamples: int, seqlen: int,
                    gen: torch.Generator) -> torch.Tensor:
    """[nsamples, seqlen] windows at random starts (drawn from `gen`) of the held-out token stream: `text_file`
    (--text), else the standard-library files calibration never reads; documents joined by `separator`."""
    texts = read_calibration_file(text_file, what="evaluation text (--text)") if text_file else heldout_texts()
    stream = token_stream(tokenizer, texts, separator)
    if len(stream) < seqlen + 1:
        raise CloverError(f"held-out text has {len(stream)} tokens; a window of {seqlen} needs at least {seqlen + 1} "
                          "(give a longer --text, or a shorter --seqlen)")
    data = torch.tensor(stream)
    starts = torch.randint(0, len(stream) - seqlen, (nsamples,), generator=gen).tolist()
    return torch.stack([data[s : s + seqlen] for s in starts])


def eval_windows(engine: Engine, text_file: str | None, nsamples: int, seqlen: int, seed: int,
                 block_size: int, mask_ratios: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids with the last block masked [n, seqlen], bool mask of the masked positions)."""
    if engine.tokenizer is None:
        raise CloverError("evaluation needs the model's tokenizer")
    if engine.mask_token_id is None:
        raise CloverError("evaluation needs the model's mask token")
    gen = torch.Generator().manual_seed(seed)
    ids = heldout_windows(engine.tokenizer, text_file, (engine.eos_token_ids or [None])[0], nsamples, seqlen, gen)
    masked = torch.zeros_like(ids, dtype=torch.bool)
    last = (seqlen - 1) // block_size * block_size
    span = seqlen - last
    for i in range(nsamples):
        r = mask_ratios[i % len(mask_ratios)]
        pos = last + torch.randperm(span, generator=gen)[: max(1, round(r * span))]
        masked[i, pos] = True
    return ids, masked


def _masked_log_probs(engine: Engine, x: torch.Tensor, masked: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 log-probabilities [n, vocab] (on the CPU) at the masked positions of windows x. With the
    engine's device current: Triton launches on the current CUDA device (a model on cuda:1 otherwise fails)."""
    with on_device(engine.device):
        logits = engine.model(x.to(engine.device), block_size=block, where=masked.to(engine.device))
    return logits.log_softmax(-1).cpu()


def _check_comparable(engine: Engine, reference: Engine) -> None:
    """KL and agreement measure what quantization changed: the same vocabulary, mask token and tokenizer, and
    the same architecture (another model's KL is how far two models are, not a quantization error)."""
    ours, theirs = engine.config, reference.config
    shape = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts")
    differ = [f"{k} {getattr(ours, k)} vs {getattr(theirs, k)}" for k in shape
              if getattr(ours, k) != getattr(theirs, k)]
    if differ:
        raise CloverError(f"the model and --against are different architectures ({', '.join(differ)}); compare a "
                          "model with the checkpoint it was quantized from")
    if ours.vocab_size != theirs.vocab_size or engine.mask_token_id != reference.mask_token_id:
        raise CloverError(
            f"the model and --against differ in vocabulary ({ours.vocab_size} vs {theirs.vocab_size} tokens, mask "
            f"id {engine.mask_token_id} vs {reference.mask_token_id}); compare a model with the checkpoint it was "
            "quantized from")
    check_same_tokenizer(engine.tokenizer, reference.tokenizer)


def check_same_tokenizer(ours: Tokenizer | None, theirs: Tokenizer | None) -> None:
    """The model and its reference tokenize a probe text alike (else their windows are different texts)."""
    probe = "The quick brown fox: 1, 22, 333; def f(x): return x"
    if ours and theirs and ours.encode(probe) != theirs.encode(probe):
        raise CloverError("the model and --against tokenize text differently; compare a model with the checkpoint "
                          "it was quantized from")


@torch.no_grad()
def evaluate(
    engine: Engine,
    reference: Engine | None = None,
    text_file: str | None = None,
    nsamples: int = 64,
    seqlen: int = 256,
    seed: int = 0,
    block_size: int | None = None,
    mask_ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0),
    batch: int = 8,
) -> EvalResult:
    if nsamples < 1 or seqlen < 1:
        raise CloverError(f"--nsamples ({nsamples}) and --seqlen ({seqlen}) must be at least 1")
    check_window(engine.config, seqlen)
    if reference is not None:
        check_window(reference.config, seqlen)
        _check_comparable(engine, reference)
    block = block_size or engine.config.block_size or 4
    ids, masked = eval_windows(engine, text_file, nsamples, seqlen, seed, block, mask_ratios)
    noisy = ids.masked_fill(masked, engine.mask_token_id)
    nll = ref_nll = kl = agree = 0.0
    n = int(masked.sum())
    for s in range(0, nsamples, batch):
        x, m, y = noisy[s : s + batch], masked[s : s + batch], ids[s : s + batch]
        logp = _masked_log_probs(engine, x, m, block)
        target = y[m]
        nll -= logp.gather(-1, target[:, None]).sum().item()
        if reference is not None:
            ref = _masked_log_probs(reference, x, m, block)
            ref_nll -= ref.gather(-1, target[:, None]).sum().item()
            kl += (ref.exp() * (ref - logp)).sum().item()
            agree += (ref.argmax(-1) == logp.argmax(-1)).sum().item()
    if not math.isfinite(nll):
        raise CloverError("the model produced non-finite log-probabilities on the evaluation text")
    has_ref = reference is not None
    return EvalResult(
        nll=nll / n,
        ref_nll=ref_nll / n if has_ref else None,
        kl=kl / n if has_ref else None,
        top1_agreement=agree / n if has_ref else None,
        positions=n,
    )
