"""Choosing tokens for masked positions: argmax or sampling, plus the confidence used to rank them.

PyTorch reference; a fused kernel (lm_head -> choice + confidence) later replaces it behind `choose`.
"""

from __future__ import annotations

import torch

CONFIDENCES = ("prob", "margin", "entropy")
# What each confidence can be (confidence_of): a probability; top choice minus the runner-up, negative when
# sampling picks a lower one; exp(-entropy). A threshold outside its range commits nothing or everything.
CONFIDENCE_RANGES = {"prob": (0.0, 1.0), "margin": (-1.0, 1.0), "entropy": (0.0, 1.0)}


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the top_k largest logits and the smallest set whose probability reaches top_p."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def choose(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    confidence: str = "prob",
    banned_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, vocab] -> (tokens [n], confidence [n] fp32).

    temperature 0 is argmax (never a division by zero). Confidence is measured on the distribution the
    token was drawn from: `prob` its probability, `margin` its probability minus the best other one,
    `entropy` exp(-H) of the distribution (ranks like negative entropy, on the same 0..1 scale as prob).
    `banned_token_id` (the mask token) is never chosen.
    """
    if confidence not in CONFIDENCES:
        raise ValueError(f"confidence must be one of {CONFIDENCES}, got '{confidence}'")
    logits = logits.float()
    if banned_token_id is not None:
        logits = logits.clone()
        logits[:, banned_token_id] = float("-inf")
    if temperature > 0:
        logits = filter_logits(logits / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    else:
        tokens = probs.argmax(-1)
    return tokens, confidence_of(probs, tokens, confidence)


def confidence_of(probs: torch.Tensor, picks: torch.Tensor, confidence: str) -> torch.Tensor:
    """probs [n, m] (a distribution per row), picks [n] (column chosen in each row) -> confidence [n]."""
    chosen = probs.gather(-1, picks[:, None]).squeeze(-1)
    if confidence == "prob":
        return chosen
    if confidence == "margin":
        other = probs.scatter(-1, picks[:, None], float("-inf")).max(-1).values
        return chosen - other
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return torch.exp(-entropy)
