"""Train the bundled clover-tiny model on a CPU (the recipe of clover_lite/data/clover-tiny).

Phases 1-2, from scratch:

    python examples/train_tiny.py prepare --workdir runs/tiny       # tokenizer + tokenized text (~1 min)
    python examples/train_tiny.py train --workdir runs/tiny --steps 1200 --threads 1 --extend-from 857
    python examples/train_tiny.py train --workdir runs/tiny --steps 2000 --threads 2 --extend-from 857 \
        --task-weights rules=4,add=2 --reweight-from 1200         # phase 2: resumes at 1200
    python examples/train_tiny.py export --workdir runs/tiny --out /tmp/clover-tiny-2000

Phases 3-5, a fine-tune of that export (fresh optimizer, its own step count and cosine) after `rules` replies
became forward derivations (the tasks.py and the phases-1-2 prior.json of commit cbd3b24):

    python examples/train_tiny.py prepare --workdir runs/ft --tokenizer-from /tmp/clover-tiny-2000
    python examples/train_tiny.py train --workdir runs/ft --init-from /tmp/clover-tiny-2000 --seed 3 \
        --steps 900 --lr 0.002 --warmup 30 --threads 2 --task-weights rules=4
    # phases 4 and 5: the same command with --steps 1400, then --steps 2100 (each resumes state.pt)
    python examples/train_tiny.py export --workdir runs/ft --out /tmp/clover-tiny-4100

Phases 6-7, after `rules` became conclusion-first rules answered by backward chaining (clover_lite/training/tasks.py).
Phase 6 fine-tunes the step-4100 export; it was stopped by hand at its step-1218 checkpoint when probes showed
rules flat at chance (42% at steps 796 and 1218). Phase 7 fine-tunes that with the training-only `recall`
task (the content lookup alone) weighted in, and rules rose to 76% within 620 steps:

    python examples/train_tiny.py prepare --workdir runs/ft6 --tokenizer-from /tmp/clover-tiny-4100
    python examples/train_tiny.py train --workdir runs/ft6 --init-from /tmp/clover-tiny-4100 --seed 7 \
        --steps 1800 --stop-at 1218 --lr 0.002 --warmup 30 --threads 2 --task-weights rules=6
    python examples/train_tiny.py export --workdir runs/ft6 --out /tmp/clover-tiny-5318
    python examples/train_tiny.py prepare --workdir runs/ft7 --tokenizer-from /tmp/clover-tiny-5318
    python examples/train_tiny.py train --workdir runs/ft7 --init-from /tmp/clover-tiny-5318 --seed 8 \
        --steps 900 --lr 0.002 --warmup 30 --threads 2 --task-weights rules=3,recall=6
    python examples/train_tiny.py export --workdir runs/ft7 --out /tmp/clover-tiny-6218

Phases 8-9: rules sat at the no-rule shortcut (73%) because the premise copied after " if" came from a rule
picked nearly at random; the training-only `cite` drill (several premise copies per instance) taught that
copy. Phase 8 is the drill almost alone, stopped at the step-440 checkpoint of its 700-step schedule (rules
copied right, but "is given" answers had weakened); phase 9 brings rules back to the front. Its card took
phases 1-8 from prior.json as it was at commit cdbd3de (`git show cdbd3de:examples/clover_tiny_prior.json`):

    python examples/train_tiny.py prepare --workdir runs/ft8 --tokenizer-from /tmp/clover-tiny-6218
    python examples/train_tiny.py train --workdir runs/ft8 --init-from /tmp/clover-tiny-6218 --seed 12 \
        --steps 700 --stop-at 440 --lr 0.002 --warmup 30 --threads 1 --task-weights rules=1,cite=10
    python examples/train_tiny.py export --workdir runs/ft8 --out /tmp/clover-tiny-6658
    python examples/train_tiny.py prepare --workdir runs/ft9 --tokenizer-from /tmp/clover-tiny-6658
    git show cdbd3de:examples/clover_tiny_prior.json > runs/ft9/prior.json
    python examples/train_tiny.py train --workdir runs/ft9 --init-from /tmp/clover-tiny-6658 --seed 13 \
        --steps 600 --lr 0.0015 --warmup 20 --threads 1 --task-weights rules=5,cite=3,recall=2

Phase 10 adds `interlocked` (several questions over one rule set, a worked line each, in one reply) at a lower
learning rate so the older tasks hold; prior.json describes phases 1-9 for the card:

    python examples/train_tiny.py export --workdir runs/ft9 --out /tmp/clover-tiny-7258
    python examples/train_tiny.py prepare --workdir runs/ft10 --tokenizer-from /tmp/clover-tiny-7258
    cp examples/clover_tiny_prior.json runs/ft10/prior.json
    python examples/train_tiny.py train --workdir runs/ft10 --init-from /tmp/clover-tiny-7258 --seed 41 \
        --steps 300 --lr 0.001 --warmup 20 --threads 1 \
        --task-weights rules=2,interlocked=4,sort=1,add=2,reverse=1,cite=1,recall=1

Evaluation, card and export:

    python examples/train_tiny.py export --workdir runs/ft10 --out /tmp/clover-tiny
    python benchmarks/quality.py --models /tmp/clover-tiny --quant rtn gptq nf4 --out /tmp/quality.json
    python examples/train_tiny.py card --workdir runs/ft10 --model /tmp/clover-tiny --quality /tmp/quality.json \
        --out /tmp/CARD.md
    python examples/train_tiny.py export --workdir runs/ft10 --out /tmp/clover-tiny-card --card /tmp/CARD.md
    cp /tmp/clover-tiny-card/{README.md,config.json,model.safetensors,tokenizer.json,tokenizer_config.json} \
        clover_lite/data/clover-tiny/    # export writes only to its own outputs (checkpoint/output.py)

Those are the bundled model's commands. Everything is deterministic in --seed (bitwise with the same thread
count); `train` picks up from WORKDIR/state.pt when it exists, so phase 2 continues phase 1's weights and
optimizer. (A curriculum phase with a training-only first step of the old yes/no `rules` was tried after
phase 2 and not kept: see the card.)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from clover_lite.checkpoint.load import Checkpoint, load_weights
from clover_lite.checkpoint.save import save_checkpoint
from clover_lite.checkpoint.tiny import tiny_config
from clover_lite.models.config import config_from_dict
from clover_lite.models.denoiser import Denoiser
from clover_lite.training import corpus, tasks
from clover_lite.training.train import TrainConfig, init_weights, jsonl_logger, lr_at, train

BLOCK_SIZE = 4


def model_config(tok: HFTokenizer) -> dict:
    """config.json of the bundled model: 8 layers (GDN + gated attention) x 4, MoE 8 experts top-2 + a
    shared expert, tied embeddings, block size 4. Half the layers are attention (Qwen3.5 has a quarter):
    at this size and budget the tasks are copying tasks, which attention learns faster."""
    ids = {t: tok.token_to_id(t) for t in corpus.SPECIALS}
    gdn, att = "linear_attention", "full_attention"
    return tiny_config(
        vocab_size=tok.get_vocab_size(), hidden_size=192, num_hidden_layers=8, layer_types=[gdn, att] * 4,
        head_dim=48, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        linear_key_head_dim=48, linear_value_head_dim=48, moe_intermediate_size=128,
        shared_expert_intermediate_size=192, norm_topk_prob=True, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        mask_token_id=ids["<|mask|>"], block_size=BLOCK_SIZE, dtype="float16",
    )


def prepare(args) -> None:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    train_files, held = corpus.split_files()
    texts = corpus.read_texts(train_files)
    t0 = time.time()
    if args.tokenizer_from:  # fine-tuning a model: its tokenizer, not a new one
        (work / "tokenizer").mkdir(exist_ok=True)
        _copy_tokenizer(Path(args.tokenizer_from), work / "tokenizer")
        tok = HFTokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    else:
        rng = random.Random(args.seed)
        chats = [tasks.chat_text(tasks.sample_train(rng)) for _ in range(20_000)]
        tok = corpus.train_tokenizer(texts + chats, vocab_size=args.vocab_size)
        corpus.write_tokenizer(tok, work / "tokenizer")
    ids = corpus.encode_corpus(tok, texts)
    torch.save(ids, work / "text_train.pt")
    info = {"train_files": len(train_files), "heldout_files": len(held), "text_tokens": ids.numel(),
            "text_bytes": sum(len(t.encode()) for t in texts), "vocab_size": tok.get_vocab_size(),
            "seconds": time.time() - t0, "python": platform.python_version()}
    (work / "data.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info))


def _model(work: Path, seed: int) -> tuple[Denoiser, dict, HFTokenizer]:
    tok = HFTokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    cfg_json = model_config(tok)
    model = init_weights(Denoiser(config_from_dict(cfg_json)).float(), seed)
    return model, cfg_json, tok


def run_train(args) -> None:
    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    model, cfg_json, tok = _model(work, args.seed)
    if args.init_from and not (work / "state.pt").exists():  # a fine-tune starts from a model's weights
        ckpt = Checkpoint(args.init_from)
        load_weights(model, ckpt)
        print(f"initialised from {args.init_from}", flush=True)
    text = torch.load(work / "text_train.pt")
    batches = corpus.MixedBatches(tok, text, args.batch, args.length, args.task_windows, args.seed,
                                  block_size=BLOCK_SIZE, extend_from=args.extend_from,
                                  task_weights=_weights(args.task_weights), reweight_from=args.reweight_from)
    cfg = TrainConfig(steps=args.steps, lr=args.lr, warmup=args.warmup, block_size=BLOCK_SIZE, seed=args.seed,
                      checkpoint_every_s=args.checkpoint_every, log_every=args.log_every, stop_at=args.stop_at)
    total, active = model.num_parameters()
    print(f"params {total / 1e6:.2f}M total, {active / 1e6:.2f}M active; {cfg}", flush=True)
    t0 = time.time()

    def log(rec: dict) -> None:
        rec["elapsed_s"] = round(time.time() - t0, 1)
        jsonl_logger(work / "log.jsonl")(rec)
        print(json.dumps(rec), flush=True)

    train(model, batches, cfg, cfg_json["mask_token_id"], checkpoint=work / "state.pt", log=log,
          progress=sys.stderr.isatty())
    (work / "run.json").write_text(json.dumps({"args": vars(args), "seconds_this_session": time.time() - t0}))
    with open(work / "phases.jsonl", "a") as f:  # one line per finished `train` command, for the card
        f.write(json.dumps(vars(args)) + "\n")


def _weights(spec: str | None) -> dict[str, int] | None:
    """'rules=4,add=2' -> {'sort': 1, 'add': 2, 'reverse': 1, 'rules': 4} (unnamed base tasks weigh 1, others 0)."""
    if not spec:
        return None
    weights = dict.fromkeys(tasks.BASE_TASKS, 1)
    for item in spec.split(","):
        name, _, w = item.partition("=")
        weights[name.strip()] = int(w)
    return weights


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())


def export(args) -> None:
    work = Path(args.workdir)
    model, cfg_json, _ = _model(work, args.seed)
    state = torch.load(work / "state.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    card = Path(args.card).read_text() if args.card else None

    def extra(d: Path) -> None:
        _copy_tokenizer(work / "tokenizer", d)
        if card is not None:
            (d / "README.md").write_text(card)

    out = save_checkpoint(model, args.out, cfg_json, dtype=torch.float16, extra_files=extra, force=True)
    print(f"wrote {out} (step {state['step']})")


def card(args) -> None:
    """The model card: the recipe and the numbers of the run and of benchmarks/quality.py."""
    work = Path(args.workdir)
    tok = HFTokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    cfg_json = model_config(tok)
    model = Denoiser(config_from_dict(cfg_json))
    total, active = model.num_parameters()
    data = json.loads((work / "data.json").read_text())
    logs = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    run = json.loads((work / "run.json").read_text())["args"]
    results = list(json.loads(Path(args.quality).read_text()).items())
    q = results[0][1]  # the 16-bit model; the rest are its 4-bit versions (benchmarks/quality.py --quant)
    last = logs[-10:]
    ce = sum(r["ce"] for r in last) / len(last)
    prior = _prior(work)
    steps = prior["steps"] + logs[-1]["step"]
    tokens = steps * run["batch"] * run["length"]
    # Wall clock of every session (elapsed_s restarts when a run resumes), work redone after a resume included.
    nexts = logs[1:] + [None]
    ends = [r for r, nxt in zip(logs, nexts, strict=True) if nxt is None or nxt["elapsed_s"] < r["elapsed_s"]]
    minutes = prior["minutes"] + sum(r["elapsed_s"] for r in ends) / 60
    template = Path(args.template).read_text()
    d = q["decoding"]
    base = d["1 per step"]
    best = max(
        (k for k in d if k != "1 per step" and d[k]["mean_accuracy"] >= base["mean_accuracy"] - 0.02),
        key=lambda k: d[k]["tokens_per_forward"], default=None,
    )
    values = {
        "total_m": f"{total / 1e6:.1f}", "active_m": f"{active / 1e6:.1f}", "vocab": cfg_json["vocab_size"],
        "block": BLOCK_SIZE, "steps": steps, "batch": run["batch"], "length": run["length"],
        "task_windows": run["task_windows"],
        "tokens_m": f"{tokens / 1e6:.1f}", "minutes": f"{minutes:.0f}",
        "lr": run["lr"], "final_ce": f"{ce:.2f}", "train_files": data["train_files"],
        "heldout_files": data["heldout_files"], "text_tokens_m": f"{data['text_tokens'] / 1e6:.1f}",
        "text_mb": f"{data['text_bytes'] / 1e6:.1f}", "py": data.get("python", "?"),
        "weights_mb": f"{q['weights_mb']:.1f}",
        "quality_table": _quality_table(q), "n_task": args.n_task,
        "text_seen_m": f"{steps * (run['batch'] - run['task_windows']) * run['length'] / 1e6:.1f}",
        **{f"acc_{t}": f"{100 * base['accuracy'][t]:.0f}" for t in tasks.TASKS},
        **{f"fail_{t}": _miss(base["first_failure"].get(t)) for t in tasks.TASKS},
        "eos_rate": f"{100 * base.get('eos_rate', float('nan')):.0f}",
        "examples": _examples(Path(args.model)),
        "base_acc": f"{100 * base['mean_accuracy']:.1f}",
        "phases": _phases(work, run, prior), "finetune_steps": logs[-1]["step"],
        **_rules_lines(base, q.get("rules_fact_lookup", float("nan"))),
        "quant_group": results[1][0].rsplit(" g", 1)[-1] if len(results) > 1 else "-",
        "quant_table": _quant_table(results),
        "best": best or "none", "best_tpf": f"{d[best]['tokens_per_forward']:.2f}" if best else "-",
        "best_reply_tpf": f"{d[best]['reply_tokens_per_forward']:.2f}" if best else "-",
        "best_acc": f"{100 * d[best]['mean_accuracy']:.1f}" if best else "-",
    }
    Path(args.out).write_text(template.format(**values))
    print(f"wrote {args.out}")


def _prior(work: Path) -> dict:
    """What came before a fine-tune (`train --init-from`): workdir/prior.json, written by hand when the
    starting model's own run directory is gone: {"steps", "minutes", "phases": [train args...]}; a phase
    that was itself a fine-tune gives the step it started from as "offset", one cut short its "stop_at"."""
    path = work / "prior.json"
    return json.loads(path.read_text()) if path.exists() else {"steps": 0, "minutes": 0.0, "phases": []}


def _phases(work: Path, run: dict, prior: dict) -> str:
    """A table of the training phases (one per `train` command that ran to its --steps or --stop-at). A
    fine-tune counts its own steps from 0; the table places it after the phases it started from."""
    path = work / "phases.jsonl"
    here = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [run]
    lines = ["| phase | steps | task weights | learning rate | threads |", "|---|---|---|---|---|"]
    start = 0
    offsets = [a.get("offset", 0) for a in prior["phases"]] + [prior["steps"]] * len(here)
    for i, (a, offset) in enumerate(zip(prior["phases"] + here, offsets, strict=True), 1):
        cfg = TrainConfig(steps=a["steps"], lr=a["lr"], warmup=a["warmup"], stop_at=a.get("stop_at"))
        weights = a.get("task_weights") or "uniform"
        first = max(start - offset, a["warmup"] - 1)
        lines.append(f"| {i} | {start}-{offset + cfg.end} | {weights} | {lr_at(first, cfg):.1e} -> "
                     f"{lr_at(cfg.end - 1, cfg):.1e} | {a['threads']} |")
        start = offset + cfg.end
    return "\n".join(lines)


def _rules_lines(base: dict, shortcut: float) -> dict:
    """The rules task goes under 'can do' when clearly above the 50% of guessing (2 sd at n = 100)."""
    acc, miss = 100 * base["accuracy"]["rules"], _miss(base["first_failure"].get("rules"))
    exact = 100 * base.get("exact", {}).get("rules", float("nan"))
    # Right / asked by how many rules the question sits behind, beside the shortcut that needs no rule.
    split = ", ".join(f"{right}/{n} behind {k}" for k, (right, n) in base.get("rules_by_steps", {}).items())
    detail = (f"right by rules behind the question: {split}; \"yes exactly when the asked atom is a fact\" "
              f"gets {100 * shortcut:.0f}%")
    if acc >= 60:
        can = (f"- **rules**: {acc:.0f}% on held-out yes/no questions about a rule set (half yes, half no: "
               f"guessing gets 50%), answered after working back from the question through the rules ({exact:.0f}% "
               f"of the chains exact; {detail}; first miss: `{miss}`).\n")
        cannot = ""
        if acc < 100 * shortcut + 5:  # above guessing, but not above what needs no rule
            cannot = (f"- **rules** behind a rule: no better overall than the shortcut that needs no rule "
                      f"({100 * shortcut:.0f}%): when it follows a rule it often copies the premise of another "
                      f"rule, so questions one or two rules deep are near chance.\n")
        return {"rules_can": can, "rules_cannot": cannot}
    cannot = (f"- **rules**: {acc:.0f}% on yes/no questions that are half yes, half no, i.e. near chance: it copies "
              f"the facts and writes a derivation ({exact:.0f}% of them exact), but its final yes/no does not follow "
              f"from what it wrote ({detail}), and threshold decoding can push it below chance (first miss: "
              f"`{miss}`).\n")
    return {"rules_can": "", "rules_cannot": cannot}


def _quant_table(results: list[tuple[str, dict]]) -> str:
    lines = ["| weights | MB | text NLL @0.5 | reply NLL @0.5 | accuracy, 1 per step | threshold 0.9: tokens/forward, "
             "accuracy |", "|---|---|---|---|---|---|"]
    for name, r in results:
        label = "16-bit" if name == results[0][0] else name.rsplit(" ", 2)[-2]
        one, t9 = r["decoding"]["1 per step"], r["decoding"].get("threshold 0.9")
        fast = f"{t9['tokens_per_forward']:.2f}, {100 * t9['mean_accuracy']:.1f}%" if t9 else "-"
        lines.append(f"| {label} | {r['weights_mb']:.1f} | {r['nll']['text@0.5']['model']:.3f} | "
                     f"{r['nll']['task replies@0.5']['model']:.3f} | {100 * one['mean_accuracy']:.1f}% | {fast} |")
    return "\n".join(lines)


def _miss(f: dict | None) -> str:
    if f is None:
        return "none"
    one_line = {k: f[k].replace("\n", "\\n") for k in ("prompt", "got", "answer")}  # inline code: no line breaks
    return f"{one_line['prompt']} -> {one_line['got']} (expected {one_line['answer']})"


def _examples(model_dir: Path) -> str:
    """The card's examples, generated by the model itself with `clover run`'s defaults."""
    import clover_lite

    engine = clover_lite.load(model_dir, device="cpu")
    lines = ["```"]
    for prompt in CARD_PROMPTS:
        out = engine.generate([{"role": "user", "content": prompt}], max_new_tokens=64)
        lines += [f'$ clover run "{prompt}"', out.text]
    # Plain text continuation (no chat template): what the Python source half of the training looks like.
    out = engine.generate(RAW_PROMPT, max_new_tokens=48, raw=True)  # as `clover run --raw`: no chat template
    escaped = RAW_PROMPT.encode("unicode_escape").decode()
    lines += [f"$ clover run --raw -n 48 $'{escaped}'", RAW_PROMPT + out.text]
    return "\n".join(lines + ["```"])


CARD_PROMPTS = ("sort: 5 3 9 1", "sort: 12 7 45 3 88", "add: 23 + 58", "add: 4 + 5", "reverse: c a b l e",
                "facts: Ann is red. rules: Bob is big if Ann is red. question: is Bob big?",
                "facts: Ann is red. rules: Bob is big if Ann is red. Cal is old if Dan is shy. questions: is Bob big? "
                "is Cal old?")
RAW_PROMPT = "import os\n\n\ndef read_config(path):\n"


def _quality_table(q: dict) -> str:
    lines = ["| held-out set @ mask ratio | model NLL | unigram NLL |", "|---|---|---|"]
    lines += [f"| {k} | {v['model']:.2f} | {v['unigram']:.2f} |" for k, v in q["nll"].items()]
    head = ("| decoding | tokens per forward | reply tokens per forward | " + " | ".join(tasks.TASKS)
            + " | mean | rules derivation |")
    lines += ["", head, "|---|---|---|" + "---|" * (len(tasks.TASKS) + 2)]
    for label, d in q["decoding"].items():
        accs = " | ".join(f"{100 * d['accuracy'][t]:.0f}%" for t in tasks.TASKS)
        lines.append(f"| {label} | {d['tokens_per_forward']:.2f} | {d['reply_tokens_per_forward']:.2f} | {accs} | "
                     f"{100 * d['mean_accuracy']:.1f}% | {100 * d.get('exact', {}).get('rules', float('nan')):.0f}% |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "train", "export", "card"):
        s = sub.add_parser(name)
        s.add_argument("--workdir", required=True)
        s.add_argument("--seed", type=int, default=0)
    sub.choices["prepare"].add_argument("--vocab-size", type=int, default=4096)
    sub.choices["prepare"].add_argument("--tokenizer-from", default=None,
                                        help="a model directory whose tokenizer to use (to fine-tune it)")
    t = sub.choices["train"]
    t.add_argument("--steps", type=int, default=1100)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--length", type=int, default=192)
    t.add_argument("--task-windows", type=int, default=13, help="windows of task chats per batch; rest is text")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--extend-from", type=int, default=0,
                   help="first step whose chats are maskable up to the end of the reply's last block (the "
                        "bundled run used 857: it was resumed with this fix after evaluation found the model "
                        "never learned where to stop)")
    t.add_argument("--task-weights", default=None,
                   help="e.g. 'rules=4,add=2': relative frequency of each task from --reweight-from on (the "
                        "bundled run used it from step 1200 after evaluation found rules at chance)")
    t.add_argument("--reweight-from", type=int, default=0)
    t.add_argument("--init-from", default=None,
                   help="a model directory to start from (fresh optimizer and schedule) when the workdir has no "
                        "state.pt: how phase 3 of the bundled model fine-tuned the phase-2 export")
    t.add_argument("--stop-at", type=int, default=None,
                   help="end after this step, keeping the --steps schedule (a phase cut short)")
    t.add_argument("--checkpoint-every", type=float, default=180.0, help="seconds")
    t.add_argument("--log-every", type=int, default=10)
    e = sub.choices["export"]
    e.add_argument("--out", required=True)
    e.add_argument("--card", default=None, help="model card (README.md) to include")
    c = sub.choices["card"]
    c.add_argument("--quality", required=True, help="benchmarks/quality.py JSON of the exported model")
    c.add_argument("--template", default=str(Path(__file__).with_name("clover_tiny_card.md")))
    c.add_argument("--n-task", type=int, default=100)
    c.add_argument("--model", required=True, help="the exported model directory (runs the card's examples)")
    c.add_argument("--out", required=True)
    args = p.parse_args()
    {"prepare": prepare, "train": run_train, "export": export, "card": card}[args.cmd](args)


if __name__ == "__main__":
    main()
