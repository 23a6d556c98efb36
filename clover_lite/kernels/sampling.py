"""Choosing tokens for the masked positions of a block in one pass over the vocabulary.

For logits [n, V] (n <= 64 masked positions, V up to 248k) the kernel streams each row once, split
over vocabulary chunks, and keeps per chunk: the max and its index, the second max, the online softmax
sums S1 = sum e^(l-m) and S2 = sum e^(l-m) (l-m) (entropy), and the Gumbel-max sample
argmax(l/T - log(-log u)) with u from Triton's counter-based RNG (a seed reproduces it). A tiny merge in
PyTorch combines the chunks. Nothing of size V is written: no softmax is ever materialised.
top-k / top-p need the most likely tokens, not a full pass: those go through `torch.topk` on the logits
and the reference sampler on the [n, k] candidates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from clover_lite.kernels.host import cdiv, interpreting, next_power_of_2
from clover_lite.runtime.sampling import CONFIDENCES, confidence_of, filter_logits


@triton.jit
def _row_stats_kernel(
    logits_ptr, stats_ptr, idx_ptr, V, n_chunks, s_lr, s_sr, s_sc, inv_temp, banned, seed,
    BLOCK_V: tl.constexpr, SAMPLE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = offs < V
    ok = in_row & (offs != banned)
    # Loaded under the row mask alone (constant over aligned runs, so 16-byte loads), the banned id after.
    x = tl.load(logits_ptr + row * s_lr + offs, mask=in_row, other=float("-inf")).to(tl.float32) * inv_temp
    x = tl.where(ok, x, float("-inf"))
    m = tl.max(x, axis=0)
    arg = tl.argmax(x, axis=0)
    second = tl.max(tl.where(tl.arange(0, BLOCK_V) == arg, float("-inf"), x), axis=0)
    d = tl.where(ok, x - m, 0.0)  # masked entries would give -inf - m (nan once multiplied by 0)
    e = tl.where(ok, tl.exp(d), 0.0)
    s1 = tl.sum(e, axis=0)
    s2 = tl.sum(e * d, axis=0)
    base = stats_ptr + row * s_sr + chunk * s_sc
    tl.store(base + 0, m)
    tl.store(base + 1, second)
    tl.store(base + 2, s1)
    tl.store(base + 3, s2)
    tl.store(idx_ptr + (row * n_chunks + chunk) * 2 + 0, (chunk * BLOCK_V + arg).to(tl.int64))
    if SAMPLE:
        u = tl.rand(seed, row * V + offs)
        gumbel = tl.where(ok, x - tl.log(-tl.log(u + 1e-20) + 1e-20), float("-inf"))
        gmax = tl.max(gumbel, axis=0)
        garg = tl.argmax(gumbel, axis=0)
        tl.store(base + 4, gmax)
        tl.store(base + 5, tl.sum(tl.where(tl.arange(0, BLOCK_V) == garg, x, 0.0), axis=0))
        tl.store(idx_ptr + (row * n_chunks + chunk) * 2 + 1, (chunk * BLOCK_V + garg).to(tl.int64))


def choose_fused(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    confidence: str = "prob",
    banned_token_id: int | None = None,
    generator: torch.Generator | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `clover_lite.runtime.sampling.choose` (tokens [n], confidence [n] fp32); greedy choices and
    all confidences equal the reference's; sampled tokens follow the same distribution, reproducibly for
    a seeded generator (a different random stream than torch.multinomial's)."""
    if confidence not in CONFIDENCES:
        raise ValueError(f"confidence must be one of {CONFIDENCES}, got '{confidence}'")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got {tuple(logits.shape)}")
    if not (logits.is_cuda or interpreting()):
        raise ValueError("the Triton sampler needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
    n, V = logits.shape
    if temperature > 0 and (top_k or top_p < 1.0):
        return _choose_filtered(logits, temperature, top_k, top_p, confidence, banned_token_id, generator)
    sample = temperature > 0
    inv_temp = 1.0 / temperature if sample else 1.0
    bv = block_v or (min(4096, next_power_of_2(V)) if not interpreting() else next_power_of_2(V))
    chunks = cdiv(V, bv)
    stats = torch.empty(n, chunks, 6, device=logits.device, dtype=torch.float32)
    idx = torch.empty(n, chunks, 2, device=logits.device, dtype=torch.int64)
    seed = 0
    if sample:  # one draw from the caller's generator seeds the kernel's counter-based stream
        dev = generator.device if generator is not None else "cpu"
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=dev).item())
    lg = logits if logits.dtype != torch.bfloat16 or not interpreting() else logits.float()
    _row_stats_kernel[(n, chunks)](
        lg, stats, idx, V, chunks, lg.stride(0), stats.stride(0), stats.stride(1), inv_temp,
        -1 if banned_token_id is None else banned_token_id, seed, BLOCK_V=bv, SAMPLE=sample,
    )
    m_c, second_c, s1_c, s2_c = stats[..., 0], stats[..., 1], stats[..., 2], stats[..., 3]
    m, best_chunk = m_c.max(1)
    scale = torch.exp(m_c - m[:, None])
    s1 = (s1_c * scale).sum(1)
    s2 = (scale * (s2_c + (m_c - m[:, None]) * s1_c)).sum(1)
    rows = torch.arange(n, device=logits.device)
    top = idx[rows, best_chunk, 0]
    # The runner-up: the best chunk's second, or another chunk's max.
    others = m_c.scatter(1, best_chunk[:, None], float("-inf")).max(1).values
    second = torch.maximum(second_c[rows, best_chunk], others)
    p_top, p_second = 1.0 / s1, torch.exp(second - m) / s1
    if sample:
        g_chunk = stats[..., 4].argmax(1)
        tokens = idx[rows, g_chunk, 1]
        chosen_logit = stats[rows, g_chunk, 5]
        p_chosen = torch.exp(chosen_logit - m) / s1
        best_other = torch.where(tokens == top, p_second, p_top)
    else:
        tokens, p_chosen, best_other = top, p_top, p_second
    if confidence == "prob":
        return tokens, p_chosen
    if confidence == "margin":
        return tokens, p_chosen - best_other
    entropy = torch.log(s1) - s2 / s1
    return tokens, torch.exp(-entropy)


def _choose_filtered(logits, temperature, top_k, top_p, confidence, banned_token_id, generator):
    """top-k / top-p: the k most likely tokens (k = top_k, else enough for top_p) through torch.topk, then the
    reference sampler on those candidates. Exact: with top_p alone the candidate set is widened until it
    holds the top_p mass."""
    x = logits.float()
    if banned_token_id is not None:
        x = x.clone()
        x[:, banned_token_id] = float("-inf")
    x = x / temperature
    V = x.shape[1]
    k = top_k if top_k else min(V, 256)
    while True:
        vals, ids = torch.topk(x, min(k, V), dim=-1)
        if top_k or k >= V:
            break
        mass = torch.exp(vals - torch.logsumexp(x, -1, keepdim=True)).sum(-1)
        if bool((mass >= top_p).all()):
            break
        k = min(V, 4 * k)
    if top_k:
        filtered = filter_logits(vals, 0, top_p)  # top-p within the top-k set, as the reference does
    else:
        # top-p measured against the whole distribution: the candidates' probabilities use the full log-sum-exp.
        p_full = torch.exp(vals - torch.logsumexp(x, -1, keepdim=True))
        drop = p_full.cumsum(-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        filtered = vals.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, -1)
    pick = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return ids.gather(-1, pick[:, None]).squeeze(-1), confidence_of(probs, pick, confidence)
