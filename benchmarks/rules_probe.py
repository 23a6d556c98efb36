"""Teacher-forced probes of the premise copy, the step of a `rules` reply that questions behind a rule need
("Bob is big if" -> "Cal": the person after " if" in the rule that concludes the atom just written).

    python benchmarks/rules_probe.py                              # the bundled model
    python benchmarks/rules_probe.py --model DIR --n 100 --heads

For each " if" in the reply of the first n held-out `rules` questions that sit behind a rule, and of n/2
fresh `cite` drills (seed 123): the right reply up to and including " if", the rest of that block masked, one
reference forward. The copy is right when the argmax at the next position is the premise's person.
`--heads`: at the same positions, the mean attention weight of every head of every attention layer on the
right premise's person and on the other rules' premise persons; a copy head puts most of its weight on them,
and it has found the rule when the right one gets the larger share. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import clover_lite
from clover_lite.models.attention import GatedAttention
from clover_lite.runtime.engine import BUNDLED_MODEL, Engine
from clover_lite.training import tasks

OUT = Path(__file__).parent / "out"


def premise_positions(engine: Engine, ex: tasks.Example) -> list[dict]:
    """One probe per " if" of the reply: ids up to the end of its block (masks after " if"), the position
    of the premise's person, its token id, and where that person stands in the rule in the prompt."""
    tok, B = engine.tokenizer, engine.config.block_size
    prompt = tok.encode(tasks.chat_prompt(ex.prompt))
    reply = tok.encode(ex.answer)
    if_id = tok.encode(" if")[0]
    probes = []
    for i, t in enumerate(reply):
        if t != if_id:
            continue
        pos = len(prompt) + i + 1
        ids = prompt + reply[: i + 1]
        ids += [engine.mask_token_id] * ((pos // B + 1) * B - len(ids))
        # The rule is the one whose conclusion's property (the token before " if") stands before " if" in
        # the prompt: properties are distinct, so exactly one does.
        right = [j for j in range(2, len(prompt)) if prompt[j - 1] == if_id and prompt[j - 2] == reply[i - 1]]
        others = [j for j in range(1, len(prompt)) if prompt[j - 1] == if_id and j not in right]
        if len(right) != 1:
            raise ValueError(f"no single rule concludes the atom before ' if' at reply token {i}: {ex.prompt!r}")
        probes.append({"ids": ids, "pos": pos, "target": reply[i + 1], "right": right[0], "others": others})
    return probes


def attention_weights(engine: Engine, ids: list[int]) -> list[torch.Tensor]:
    """Softmax attention weights [heads, L, L] of every attention layer in a reference forward of ids."""
    found: list[torch.Tensor] = []

    def capture(attn: GatedAttention, args: tuple) -> None:
        x, cos, sin, mask = args[:4]
        q, _ = attn.project_q(x, cos, sin)
        k = attn.project_kv(x, cos, sin).k.repeat_interleave(attn.n_heads // attn.n_kv, dim=1)
        scores = (q @ k.transpose(-1, -2)).float() * attn.head_dim**-0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        found.append(scores.softmax(-1)[0])

    hooks = [m.register_forward_pre_hook(capture) for m in engine.model.modules() if isinstance(m, GatedAttention)]
    try:
        engine.model(torch.tensor([ids]), block_size=engine.config.block_size)
    finally:
        for h in hooks:
            h.remove()
    return found


@torch.no_grad()
def probe(engine: Engine, examples: Sequence[tasks.Example], heads: bool = False) -> dict:
    """Premise copies right out of those probed, and with `heads` the mean weight per attention head."""
    right = n = 0
    weight: dict[str, list[float]] = {}
    for ex in examples:
        for p in premise_positions(engine, ex):
            logits = engine.model(torch.tensor([p["ids"]]), block_size=engine.config.block_size)[0, p["pos"]]
            right += int(logits.argmax()) == p["target"]
            n += 1
            if heads:
                attention_layers = [i for i, t in enumerate(engine.config.layer_types) if t == "full_attention"]
                for layer, w in zip(attention_layers, attention_weights(engine, p["ids"]), strict=True):
                    for h in range(w.shape[0]):
                        row = w[h, p["pos"]]
                        acc = weight.setdefault(f"layer {layer} head {h}", [0.0, 0.0])
                        acc[0] += float(row[p["right"]])
                        acc[1] += float(row[p["others"]].sum())
    out: dict = {"probes": n, "right": right}
    if heads:
        out["heads"] = {k: {"right": r / n, "other rules": o / n} for k, (r, o) in weight.items()}
    return out


def probe_sets(n: int) -> dict[str, list[tasks.Example]]:
    behind = [ex for ex in tasks.heldout("rules") if tasks.rule_steps(ex) > 0][:n]
    rng = random.Random(123)
    return {"rules": behind, "cite": [tasks.generate("cite", rng) for _ in range(max(n // 2, 1))]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED_MODEL))
    p.add_argument("--n", type=int, default=100, help="held-out rules questions behind a rule")
    p.add_argument("--heads", action="store_true", help="also the attention weight of every head")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(OUT / "rules_probe.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = clover_lite.load(args.model, device="cpu")
    results = {name: probe(engine, exs, args.heads) for name, exs in probe_sets(args.n).items()}
    for name, r in results.items():
        print(f"{name}: premise copy right {r['right']}/{r['probes']}")
        for head, w in r.get("heads", {}).items():
            print(f"  {head}: right premise {w['right']:.3f}, other rules' premises {w['other rules']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, **results}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
