"""Block-diffusion training of a `Denoiser` (SDAR / BD3-LM objective), every block of a window at once.

Objective: a window of T tokens is cut into blocks of B on the grid from position 0. Each block gets a
mask ratio t ~ U(0, 1] and ceil(t * B) of its positions are replaced by the mask token; the loss is the
cross-entropy of the clean token at each masked position (no shift: a masked position predicts itself,
as `clover_lite.runtime.generation` scores it), with the clean prefix visible.

One forward trains every block: the clean window and its noisy copy run side by side through the
runtime's own layer modules. Clean positions see the clean window block-causally (what a DenoiseCache
holds after committing those blocks); a noisy block sees the clean blocks before it and itself. GDN
layers run the clean window chunked with chunk = B (`gdn_block_states`), which gives the committed
state at every block start; each noisy block then runs from that state as a separate sequence. So the
logits of noisy block b equal `model(clean[:bB] + noisy block b, block_size=B)` there (tests/test_train.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from clover_lite.models.denoiser import Denoiser
from clover_lite.models.gdn import gdn_block_states
from clover_lite.models.moe import SparseMoE


# ---- noise -------------------------------------------------------------------------------------
def noise_blocks(
    clean: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    generator: torch.Generator,
    ratio: float | None = None,
    maskable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask every block of clean [b, T] at its own ratio t ~ U(0, 1]: ceil(t * m) random positions of the
    block's m maskable ones (`ratio` fixes t for every block, for evaluation). `maskable` (bool [b, T],
    default all) keeps the other positions clean, e.g. the prompt of a chat, as SFT of diffusion LMs does.

    Returns (noisy ids, bool mask of the masked positions); a block with a maskable position masks >= 1.
    """
    b, T = clean.shape
    if T % block_size:
        raise ValueError(f"window length {T} is not a multiple of the block size {block_size}")
    nb = T // block_size
    if ratio is not None and not 0 < ratio <= 1:
        raise ValueError(f"mask ratio must be in (0, 1], got {ratio}")
    t = 1.0 - torch.rand(b, nb, 1, generator=generator) if ratio is None else torch.full((b, nb, 1), ratio)
    keys = torch.rand(b, nb, block_size, generator=generator)
    if maskable is None:
        m = torch.full((b, nb, 1), float(block_size))
    else:
        allowed = maskable.reshape(b, nb, block_size).cpu()
        m = allowed.sum(-1, keepdim=True).float()
        keys = torch.where(allowed, keys, torch.full_like(keys, 2.0))  # never among the lowest ranks
    n_masked = torch.minimum(torch.ceil(t * m).clamp(min=1), m)
    # A random permutation rank per position; the n lowest ranks of a block are masked.
    rank = keys.argsort(-1).argsort(-1)
    masked = (rank < n_masked).reshape(b, T).to(clean.device)
    noisy = torch.where(masked, torch.full_like(clean, mask_token_id), clean)
    return noisy, masked


# ---- the training forward ----------------------------------------------------------------------
def two_stream_mask(T: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Visibility [2T, 2T] for the sequence [clean; noisy] (True = visible).

    clean query in block i: clean keys of blocks <= i. noisy query in block i: clean keys of blocks < i
    and noisy keys of block i. Clean queries never see noisy keys.
    """
    blk = torch.arange(T, device=device) // block_size
    q, k = blk[:, None], blk[None, :]
    top = torch.cat([k <= q, torch.zeros(T, T, dtype=torch.bool, device=device)], dim=1)
    bottom = torch.cat([k < q, k == q], dim=1)
    return torch.cat([top, bottom], dim=0)


@dataclass
class ForwardOut:
    hidden: torch.Tensor  # [b, T, hidden]: final hidden states of the noisy copy (before the final norm)
    aux_loss: torch.Tensor  # MoE load-balancing loss (mean over MoE layers; 0 without MoE)
    expert_load: torch.Tensor  # [moe layers, experts] fraction of routed (token, k) pairs per expert


def block_diffusion_forward(model: Denoiser, clean: torch.Tensor, noisy: torch.Tensor, block_size: int) -> ForwardOut:
    """Hidden states of every noisy block given the clean blocks before it (see the module docstring)."""
    b, T = clean.shape
    B = block_size
    if T % B:
        raise ValueError(f"window length {T} is not a multiple of the block size {B}")
    nb = T // B
    device = clean.device
    x = model.embed_tokens(torch.cat([clean, noisy], dim=1))
    pos = torch.arange(T, device=device)
    cos, sin = model.rotary(torch.cat([pos, pos]))
    mask = two_stream_mask(T, B, device)
    aux, loads = [], []
    for layer in model.layers:
        if layer.kind == "full_attention":
            mixed, _ = layer.mix(x, cos, sin, mask, None, None)
        else:
            h = layer.input_layernorm(x)
            clean_out, rec, tails = gdn_block_states(layer.linear_attn, h[:, :T], B)
            # Each noisy block is its own sequence, starting from the committed state at its block start.
            hn = h[:, T:].reshape(b * nb, B, -1)
            state = (rec.reshape(b * nb, *rec.shape[2:]), tails.reshape(b * nb, *tails.shape[2:]))
            noisy_out, _ = layer.linear_attn(hn, state)
            mixed = torch.cat([clean_out, noisy_out.reshape(b, T, -1)], dim=1)
        x = x + mixed
        h = layer.post_attention_layernorm(x)
        if isinstance(layer.mlp, SparseMoE):
            out, probs, ids = layer.mlp(h, return_routing=True)
            a, load = load_balancing_loss(probs, ids)
            aux.append(a)
            loads.append(load)
        else:
            out = layer.mlp(h)
        x = x + out
    aux_loss = torch.stack(aux).mean() if aux else x.new_zeros(())
    expert_load = torch.stack(loads) if loads else x.new_zeros(0, 0)
    return ForwardOut(hidden=x[:, T:], aux_loss=aux_loss, expert_load=expert_load)


def load_balancing_loss(probs: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Switch-Transformer balance loss E * sum_e f_e * P_e (1.0 when routing is uniform) from the router's
    probabilities [T, E] and chosen ids [T, k]: f_e is the share of routed (token, k) pairs and P_e the mean
    router probability of expert e. Also returns f."""
    n_exp = probs.shape[-1]
    frac = torch.bincount(ids.reshape(-1), minlength=n_exp).float() / ids.numel()
    return n_exp * (frac * probs.mean(0)).sum(), frac


def block_diffusion_logits(model: Denoiser, clean: torch.Tensor, noisy: torch.Tensor, block_size: int) -> torch.Tensor:
    """Logits [b, T, vocab] (fp32) of every position of the noisy copy: the reference for tests; training
    computes logits only at masked positions."""
    return model.logits(block_diffusion_forward(model, clean, noisy, block_size).hidden)


@dataclass
class LossOut:
    loss: torch.Tensor  # what is minimised: ce + aux_weight * aux
    ce: torch.Tensor  # mean cross-entropy over masked positions (nats per token)
    aux: torch.Tensor
    masked_tokens: int
    expert_load: torch.Tensor


def block_diffusion_loss(
    model: Denoiser,
    clean: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    generator: torch.Generator,
    aux_weight: float = 0.01,
    maskable: torch.Tensor | None = None,
) -> LossOut:
    """Noise every block of clean [b, T], run the two-stream forward, CE on the masked positions only."""
    noisy, masked = noise_blocks(clean, block_size, mask_token_id, generator, maskable=maskable)
    out = block_diffusion_forward(model, clean, noisy, block_size)
    logits = model.logits(out.hidden[masked])  # only masked rows ever reach the vocabulary
    # A batch with nothing maskable trains only the router balance (CE of no token is 0, not NaN).
    ce = F.cross_entropy(logits, clean[masked]) if masked.any() else logits.sum() * 0.0
    return LossOut(ce + aux_weight * out.aux_loss, ce, out.aux_loss.detach(), int(masked.sum()), out.expert_load)


# ---- initialisation ----------------------------------------------------------------------------
@torch.no_grad()
def init_weights(model: Denoiser, seed: int, std: float = 0.02) -> Denoiser:
    """GPT-2 style init on the Qwen3.5 parameterisation: N(0, std) matrices, residual output projections
    scaled by 1/sqrt(2 * layers), zero-centred norms at 0 (scale 1), GDN decay as in Gated DeltaNet
    (A in [1, 16], dt in [1e-3, 1e-1] through an inverse softplus)."""
    gen = torch.Generator().manual_seed(seed)
    out_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith("linear_attn.norm.weight"):
            p.fill_(1.0)  # gated norm: plain weight
        elif "norm" in name:
            p.zero_()  # (1 + w) norms
        elif name.endswith("conv1d.weight"):
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")):
            p.copy_(out_std * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen))
    return model


# ---- the loop ----------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    aux_weight: float = 0.01
    block_size: int = 4
    seed: int = 0
    checkpoint_every_s: float = 180.0  # also at the end; 0 disables the time-based ones
    log_every: int = 10
    stop_at: int | None = None  # end after this step of the `steps`-step schedule (a phase cut short)

    @property
    def end(self) -> int:
        """The step training stops at: `steps`, or `stop_at` when a phase is cut short."""
        return self.steps if self.stop_at is None else min(self.stop_at, self.steps)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model: Denoiser, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms, GDN decay parameters and the (rarely large) embedding."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        no_wd = p.dim() < 2 or "norm" in name or name.startswith("embed_tokens")
        (plain if no_wd else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


# step -> clean token windows [b, T], or (windows, maskable bool [b, T]); deterministic in the step.
BatchFn = Callable[[int], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


def save_state(path: Path, model: Denoiser, opt: torch.optim.Optimizer, step: int, extra: dict) -> None:
    """Atomic training checkpoint: model + optimizer + step (data and noise are functions of the step)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "extra": extra}, tmp)
    os.replace(tmp, path)


def train(
    model: Denoiser,
    batch_fn: BatchFn,
    cfg: TrainConfig,
    mask_token_id: int,
    checkpoint: str | os.PathLike | None = None,
    log: Callable[[dict], None] | None = None,
    progress: bool = False,
) -> list[dict]:
    """Train `model` in place for cfg.steps steps; resumes from `checkpoint` when it exists.

    Deterministic: the batch of step s is batch_fn(s) and its noise comes from a generator seeded with
    (seed, s), so an interrupted and resumed run ends with the same weights as an uninterrupted one.
    Returns one record per logged step (step, loss, ce, aux, lr, tokens/s, ...).
    """
    opt = make_optimizer(model, cfg)
    start = 0
    ckpt = Path(checkpoint) if checkpoint is not None else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    history: list[dict] = []
    bar = _progress(progress)
    end = cfg.end
    task = bar.add_task("train", total=end, completed=start, loss=float("nan")) if bar else None
    last_save = time.monotonic()
    t_log, tok_log = time.monotonic(), 0
    model.train()
    try:
        for step in range(start, end):
            batch = batch_fn(step)
            clean, maskable = batch if isinstance(batch, tuple) else (batch, None)
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            out = block_diffusion_loss(model, clean, cfg.block_size, mask_token_id, gen, cfg.aux_weight, maskable)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            tok_log += clean.numel()
            done = step + 1
            if bar:
                bar.update(task, completed=done, loss=out.ce.item())
            if done % cfg.log_every == 0 or done == end:
                now = time.monotonic()
                load = out.expert_load
                rec = {
                    "step": done, "loss": out.loss.item(), "ce": out.ce.item(), "aux": out.aux.item(),
                    "lr": lr_at(step, cfg), "grad_norm": float(gnorm), "masked_tokens": out.masked_tokens,
                    "tokens_per_s": tok_log / max(now - t_log, 1e-9),
                    "expert_load_min": float(load.min()) if load.numel() else 0.0,
                    "expert_load_max": float(load.max()) if load.numel() else 0.0,
                }
                t_log, tok_log = now, 0
                history.append(rec)
                if log:
                    log(rec)
            timed = cfg.checkpoint_every_s > 0 and time.monotonic() - last_save >= cfg.checkpoint_every_s
            if ckpt is not None and (timed or done == end):
                save_state(ckpt, model, opt, done, {"train_config": asdict(cfg)})
                last_save = time.monotonic()
    finally:
        if bar:
            bar.stop()
    model.eval()
    return history


def _progress(enabled: bool):
    if not enabled:
        return None
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(), TimeRemainingColumn(),
    )
    bar.start()
    return bar


def jsonl_logger(path: str | os.PathLike) -> Callable[[dict], None]:
    """A `log` callback appending one JSON line per record (flushed, so `tail -f` follows the run)."""
    def write(rec: dict) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    return write
