"""SDAR and LLaDA2 on their own published decoding loops: our cached loop raced against each one, and INT4.

The published loops, rewritten here in plain torch (greedy, full recompute of the whole sequence every step,
no KV cache), calling only the model's block-causal reference forward, `engine.model(ids, block_size=B)`:

* `sdar_reference`: JetAstra/SDAR generate.py, `block_diffusion_generate`. Fixed grid of `block_length` from
  position 0, `num_blocks = ceil((P + gen_length) / B)` full blocks (the last one is decoded whole, even past
  `gen_length`); the prompt's whole blocks are prefilled and its partial block is the first decoded one, its
  prompt tail kept. Each block takes up to `denoising_steps` steps; step s may commit `num_transfer_tokens[s]`
  (`get_num_transfer_tokens`: B // steps each, the remainder to the first steps). `remasking_strategy`:
  `low_confidence_static` commits the top `num_transfer_tokens[s]` confidences; `low_confidence_dynamic`
  commits every masked position whose confidence is `> confidence_threshold` when there are at least
  `num_transfer_tokens[s]` of them, else the top `num_transfer_tokens[s]`. Confidence: the chosen token's
  probability under the softmax of the whole vocabulary (the mask token is not excluded). Stop: after a
  finished block, when any `stopping_criteria_idx` id is among the generated tokens.
* `llada2_reference`: inclusionAI LLaDA2.0 modeling_llada2_moe.py, `LLaDA2MoeModelLM.generate` (the model
  card's `model.generate(...)`). Same grid and prompt handling; `steps = min(steps, gen_length //
  minimal_topk)`; per step `num_to_transfer = _get_num_transfer_tokens(block_length, steps)[step]`; commit all
  masked positions with confidence `> threshold` if at least `num_to_transfer` pass, else the top
  `min(num_to_transfer, masked)`. Greedy (`_sample_with_temperature_topk_topp`, temperature 0, no top-k/p):
  argmax of the logits, confidence its full-vocabulary softmax probability. `eos_early_stop`: after a step
  that committed `eos_id`, return up to the first `eos_id` if no mask precedes it; in any case stop after the
  block in which `eos_id` appears; the output ends at (and includes) the first `eos_id`.

SDAR's generate.py samples only (`torch.multinomial` at temperature > 0, its confidence measured at that
temperature); its greedy form here is LLaDA2's: argmax, confidence the temperature-1 probability.

    python benchmarks/families.py                          # hidden 256, 4 layers, 1000-token prompt, 56 new
    python benchmarks/families.py --out families.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

KINDS = ("sdar", "sdar_moe", "llada2")
FAMILY_BLOCK = {"sdar": 4, "sdar_moe": 4, "llada2": 32}  # the families' trained block sizes
Forward = Callable[[torch.Tensor, int], torch.Tensor]  # (ids [1, L], block) -> logits [1, L, V]


# ---- the published loops, greedy and full recompute ---------------------------------------------
def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, V] -> (argmax token [n], its probability under the full-vocabulary softmax [n])."""
    logits = logits.float()
    token = logits.argmax(-1)
    prob = torch.softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    return token, prob


def num_transfer_tokens(block_length: int, steps: int) -> list[int]:
    """SDAR's get_num_transfer_tokens / LLaDA2's _get_num_transfer_tokens: remainder to the first steps."""
    base, rem = divmod(block_length, steps)
    return [base + (1 if s < rem else 0) for s in range(steps)]


@torch.no_grad()
def sdar_reference(forward: Forward, prompt: Sequence[int], mask_id: int, gen_length: int, block_length: int = 4,
                   denoising_steps: int = 4, remasking_strategy: str = "low_confidence_dynamic",
                   confidence_threshold: float = 0.85, stopping_criteria_idx: Sequence[int] | None = None,
                   trace: list | None = None) -> tuple[list[int], int]:
    """SDAR's block_diffusion_generate, greedy, recomputing x[:, :(block + 1) * B] every step. Returns the
    whole sequence x (prompt, every decoded block in full, masks in blocks never reached) and the forwards;
    `trace` gets each step's (positions written, tokens written)."""
    B, P = block_length, len(prompt)
    num_blocks = (P + gen_length + B - 1) // B
    x = torch.full((num_blocks * B,), mask_id, dtype=torch.long)
    x[:P] = torch.tensor(list(prompt), dtype=torch.long)
    schedule = num_transfer_tokens(B, denoising_steps)
    forwards = 0
    for nb in range(P // B, num_blocks):
        lo, hi = nb * B, (nb + 1) * B
        cur = x[lo:hi]  # a view: writes land in x
        for step in range(denoising_steps + 1):
            mask_index = cur == mask_id
            if mask_index.sum() == 0:
                break  # (the published loop runs one more forward here, only to store the block's KV cache)
            logits = forward(x[None, :hi], B)[0, lo:hi]
            forwards += 1
            x0, x0_p = greedy_pick(logits)
            confidence = torch.where(mask_index, x0_p, -torch.inf)
            transfer = torch.zeros(B, dtype=torch.bool)
            k = schedule[step]
            if remasking_strategy == "low_confidence_static":
                transfer[torch.topk(confidence, k).indices] = True
            elif remasking_strategy == "low_confidence_dynamic":
                high = confidence > confidence_threshold
                if int(high.sum()) >= k:
                    transfer = high
                else:
                    transfer[torch.topk(confidence, k).indices] = True
            else:
                raise ValueError(f"unknown remasking strategy {remasking_strategy}")
            cur[transfer] = x0[transfer]
            if trace is not None:
                where = transfer.nonzero().flatten()
                trace.append(((lo + where).tolist(), x0[where].tolist()))
        if stopping_criteria_idx is not None and any(s in x[P:].tolist() for s in stopping_criteria_idx):
            break
    return x.tolist(), forwards


@torch.no_grad()
def llada2_reference(forward: Forward, prompt: Sequence[int], mask_id: int, gen_length: int,
                     block_length: int = 32, steps: int = 32, threshold: float = 0.95, minimal_topk: int = 1,
                     eos_early_stop: bool = False, eos_id: int | None = None,
                     trace: list | None = None) -> tuple[list[int], int]:
    """LLaDA2's generate, greedy, recomputing x[:, :window_end] every step. Returns the output sequence (prompt
    + generated, cut after the first eos_id as the published method does) and the forwards; `trace` gets
    each step's (positions written, tokens written)."""
    steps = min(steps, gen_length // minimal_topk)
    B, P = block_length, len(prompt)
    num_blocks = (P + gen_length + B - 1) // B
    x = torch.full((num_blocks * B,), mask_id, dtype=torch.long)
    x[:P] = torch.tensor(list(prompt), dtype=torch.long)
    schedule = num_transfer_tokens(B, steps)
    forwards = 0
    for nb in range(P // B, num_blocks):
        end = (nb + 1) * B
        for step in range(steps):
            active = x[end - B:end] == mask_id
            if active.sum() == 0:
                break
            logits = forward(x[None, :end], B)[0, end - B:end]
            forwards += 1
            x0, x0_p = greedy_pick(logits)
            k = schedule[step]
            confidence = torch.where(active, x0_p, -torch.inf)
            high = confidence > threshold
            if int(high.sum()) >= k:
                transfer = high
            else:
                transfer = torch.zeros(B, dtype=torch.bool)
                transfer[torch.topk(confidence, min(k, int(active.sum()))).indices] = True
            x[end - B:end][transfer] = x0[transfer]
            if trace is not None:
                where = transfer.nonzero().flatten()
                trace.append(((end - B + where).tolist(), x0[where].tolist()))
            if eos_early_stop and eos_id is not None and bool((x0[transfer] == eos_id).any()):
                hits = (x[:end] == eos_id).nonzero().flatten()  # (the prompt too, as published)
                if len(hits):
                    pos = int(hits[0])
                    if bool((x[P:pos] != mask_id).all()):
                        return x[:pos + 1].tolist(), forwards
        if eos_id is not None and bool((x[P:end] == eos_id).any()):
            break
    out = x[:P + gen_length]
    hits = (out[P:] == eos_id).nonzero().flatten() if eos_id is not None else torch.empty(0)
    return out[:P + (int(hits[0]) + 1 if len(hits) else gen_length)].tolist(), forwards


def reference_forward(engine) -> Forward:
    """The block-causal reference forward of an engine's model, fp32 logits, no cache."""
    def forward(ids: torch.Tensor, block: int) -> torch.Tensor:
        return engine.model(ids.to(engine.model.embed_tokens.weight.device), block_size=block).float().cpu()
    return forward


def run_reference(kind: str, engine, prompt: Sequence[int], new_tokens: int, block: int, rule: str,
                  steps: int, threshold: float, eos_id: int | None = None,
                  trace: list | None = None) -> tuple[list[int], int]:
    """The family's own loop for `rule` ("fixed": low-confidence static / top-k per step; "threshold": the
    dynamic rule) -> (generated tokens, cut before the first `eos_id`; forwards)."""
    fwd, mask, P = reference_forward(engine), engine.mask_token_id, len(prompt)
    if kind == "llada2":
        # LLaDA2 has no static rule: a threshold no probability exceeds makes it the top-k schedule.
        x, n = llada2_reference(fwd, prompt, mask, new_tokens, block, steps, threshold if rule == "threshold"
                                else 1.0, eos_early_stop=eos_id is not None, eos_id=eos_id, trace=trace)
    else:
        strategy = "low_confidence_dynamic" if rule == "threshold" else "low_confidence_static"
        x, n = sdar_reference(fwd, prompt, mask, new_tokens, block, steps, strategy, threshold,
                              None if eos_id is None else [eos_id], trace)
    gen = x[P:P + new_tokens]
    if eos_id is not None and eos_id in gen:
        gen = gen[:gen.index(eos_id)]
    return gen, n


def run_ours(engine, prompt: Sequence[int], new_tokens: int, block: int, rule: str, steps: int,
             threshold: float, eos: bool = False):
    return engine.generate(list(prompt), max_new_tokens=new_tokens, block_size=block, policy=rule,
                           steps_per_block=steps, threshold=threshold, ignore_eos=not eos)


# ---- models -------------------------------------------------------------------------------------
def mask_id_of(kind: str) -> int:
    from clover_lite.checkpoint.tiny_families import LLADA2_SPECIALS, SDAR_SPECIALS

    return 256 + (LLADA2_SPECIALS.index("<|mask|>") if kind == "llada2" else SDAR_SPECIALS.index("<|MASK|>"))


def write_model(out: Path, kind: str, seed: int = 0, logit_std: float | None = 3.2, **overrides) -> Path:
    """A tiny random `kind` checkpoint (tiny_families). `logit_std`: scale its lm_head so the logits spread
    about that much, as a trained model's do (random weights give near-uniform distributions, confidences
    all about 1/vocab); the mask token's row is zeroed (logit 0), so that, as in a trained model, it is never
    the argmax and its probability is negligible (ours never picks it, the published loops could)."""
    from safetensors.torch import load_file, save_file

    from clover_lite.checkpoint.tiny_families import write_family_checkpoint

    path = write_family_checkpoint(out, kind, seed=seed, **overrides)
    if logit_std is not None:
        file = path / "model.safetensors"
        tensors = load_file(str(file))
        w = tensors["lm_head.weight"]
        w.mul_(logit_std / (w.std().item() * math.sqrt(w.shape[1])))
        w[mask_id_of(kind)] = 0
        save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def load(path: Path):
    import clover_lite

    return clover_lite.load(path, device="cpu")


# ---- the race -----------------------------------------------------------------------------------
def race(kind: str, engine, prompt: list[int], new_tokens: int, rule: str, threshold: float,
         repeats: int = 1) -> dict:
    block = FAMILY_BLOCK[kind]
    steps = block  # the published defaults: SDAR's denoising_steps = block_length = 4, LLaDA2's steps = 32
    run_ours(engine, prompt, new_tokens, block, rule, steps, threshold)  # warm-up (the cache's allocation)
    ours_s, ref_s = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        ours = run_ours(engine, prompt, new_tokens, block, rule, steps, threshold)
        ours_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref, ref_forwards = run_reference(kind, engine, prompt, new_tokens, block, rule, steps, threshold)
        ref_s.append(time.perf_counter() - t)
    return {
        "family": kind, "rule": rule, "threshold": threshold, "block": block, "prompt_tokens": len(prompt),
        "new_tokens": new_tokens, "identical_tokens": ours.token_ids == ref,
        "ours_forwards": ours.stats.forwards, "reference_forwards": ref_forwards,
        "ours_s": min(ours_s), "reference_s": min(ref_s), "speedup": min(ref_s) / min(ours_s),
    }


# ---- INT4 GPTQ against 16-bit -------------------------------------------------------------------
@torch.no_grad()
def quant_quality(kind: str, src: Path, out: Path, group_size: int, nsamples: int, seqlen: int,
                  eval_seqs: int, eval_len: int, seed: int = 1234) -> dict:
    """GPTQ INT4 `src` into `out`, then KL(16-bit || INT4) and top-1 agreement of the block-causal reference
    forward's logits on random token sequences (held out: calibration reads the standard library's text)."""
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

    t = time.perf_counter()
    report = quantize_model(src, out, QuantizeOptions(method="gptq", group_size=group_size, nsamples=nsamples,
                                                      seqlen=seqlen))
    quant_s = time.perf_counter() - t
    e16, e4 = load(src), load(report.out)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (eval_seqs, eval_len), generator=gen)
    block = FAMILY_BLOCK[kind]
    kl, agree, n = 0.0, 0, 0
    for row in ids:
        a = e16.model(row[None], block_size=block)[0].float()
        b = e4.model(row[None], block_size=block)[0].float()
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl += float((la.exp() * (la - lb)).sum(-1).sum())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += row.numel()

    def mib(p: Path) -> float:
        return sum(f.stat().st_size for f in Path(p).glob("*.safetensors")) / 2**20

    return {"family": kind, "group_size": report.group_size, "quantize_s": quant_s, "kl": kl / n,
            "top1_agreement": agree / n, "positions": n, "mib_16bit": mib(src), "mib_int4": mib(report.out)}


# ---- the script ---------------------------------------------------------------------------------
def table(races: list[dict], quants: list[dict]) -> str:
    lines = ["| family | rule | prompt | new | identical | forwards ours / ref | ours s | reference s | speedup |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in races:
        lines.append(f"| {r['family']} | {r['rule']} {r['threshold']:g} | {r['prompt_tokens']} | {r['new_tokens']} "
                     f"| {'yes' if r['identical_tokens'] else 'NO'} | {r['ours_forwards']} / "
                     f"{r['reference_forwards']} | {r['ours_s']:.2f} | {r['reference_s']:.2f} | "
                     f"{r['speedup']:.1f}x |")
    lines += ["", "| family | INT4 GPTQ g | KL(16-bit ‖ INT4) | top-1 agreement | MiB 16-bit → INT4 | quantize s |",
              "|---|---:|---:|---:|---|---:|"]
    for q in quants:
        lines.append(f"| {q['family']} | {q['group_size']} | {q['kl']:.5f} | {q['top1_agreement']:.3f} | "
                     f"{q['mib_16bit']:.2f} → {q['mib_int4']:.2f} | {q['quantize_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=56, help="prompt + new must end on every family's grid")
    ap.add_argument("--rules", nargs="+", default=["threshold"], choices=["threshold", "fixed"])
    ap.add_argument("--threshold", type=float, default=None,
                    help="default: each reference's own (SDAR 0.85, LLaDA2 0.95); with --rules fixed unused")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--eval-seqs", type=int, default=8)
    ap.add_argument("--eval-len", type=int, default=128)
    ap.add_argument("--no-quant", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared CPU)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    for kind in args.families:
        if (args.prompt_len + args.new_tokens) % FAMILY_BLOCK[kind]:
            ap.error(f"prompt + new tokens ({args.prompt_len + args.new_tokens}) must be a multiple of {kind}'s "
                     f"block ({FAMILY_BLOCK[kind]}): the published loops decode the last block whole, ours stops "
                     "at max_new_tokens, so a ragged end is decoded differently")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    heads = max(1, args.hidden // 32)
    size = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2), "head_dim": 32, "intermediate_size": 2 * args.hidden}
    races, quants = [], []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, kind in enumerate(args.families):
            overrides = dict(size)
            if kind == "llada2":
                overrides["rotary_dim"] = 16
            src = write_model(Path(tmp) / kind, kind, seed=args.seed + i, **overrides)
            engine = load(src)
            gen = torch.Generator().manual_seed(args.seed + 100 + i)
            prompt = torch.randint(0, 256, (args.prompt_len,), generator=gen).tolist()
            for rule in args.rules:
                thr = args.threshold if args.threshold is not None else (0.95 if kind == "llada2" else 0.85)
                r = race(kind, engine, prompt, args.new_tokens, rule, thr, args.repeats)
                races.append(r)
                print(f"{kind} {rule}: identical={r['identical_tokens']} ours {r['ours_s']:.2f}s "
                      f"reference {r['reference_s']:.2f}s ({r['speedup']:.1f}x)", file=sys.stderr)
            if not args.no_quant:
                q = quant_quality(kind, src, Path(tmp) / f"{kind}-int4", args.group_size, args.nsamples,
                                  args.seqlen, args.eval_seqs, args.eval_len)
                quants.append(q)
                print(f"{kind} int4: kl={q['kl']:.5f} top1={q['top1_agreement']:.3f}", file=sys.stderr)
    result = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "device": "cpu",
              "torch_threads": torch.get_num_threads(), "hidden": args.hidden, "layers": args.layers,
              "seconds": time.perf_counter() - t0, "races": races, "quant": quants}
    print(table(races, quants))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if not all(r["identical_tokens"] for r in races):
        print("FAIL: our tokens differ from a reference's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
