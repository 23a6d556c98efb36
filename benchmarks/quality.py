"""Quality of a block-diffusion model on the held-out split: masked-token NLL vs a unigram baseline, task
accuracy, and tokens per forward against the decoding threshold (the speed/quality curve).

    python benchmarks/quality.py                                  # the bundled model
    python benchmarks/quality.py --models DIR [DIR ...] --n-task 200
    python benchmarks/quality.py --quant rtn gptq nf4           # + its 4-bit versions, quantized here

Every model directory is one set of rows (e.g. the bundled model and its INT4 variants; `--quant` makes
those with `clover quantize`'s pipeline, calibrated on the training split, in a temporary directory):
`evaluate(engine, heldout_data(engine, n))` returns a dict (the held-out data is built once per tokenizer);
`main` prints a table, writes benchmarks/out/quality.json and, when matplotlib is importable,
benchmarks/out/quality.png (accuracy against tokens per forward).

- NLL: held-out text (stdlib files held out by `clover_lite.corpus`) and held-out task chats, in windows
  on the block grid; every block masked at a fixed ratio (ceil(r * B) positions), the clean prefix
  visible: the training objective at that ratio, computed with the training forward (equal to the
  runtime's reference forward, tests/test_train.py). Unigram: token frequencies of the training split.
- Tasks: greedy generation with the Engine on held-out instances, exact match of the answer (`rules`: its
  final yes/no, `interlocked`: every line's, `tasks.is_correct`; `exact` also counts the derivations). Rules accuracy
  is also split by how many rules the question sits behind (`tasks.rule_steps`), beside the shortcut "yes
  exactly when the asked atom is a fact", which needs no rule and scores ~75% (half the questions need none).
- Decoding: one token per step (`fixed`, steps = block size) and `threshold` at several values. Tokens per
  forward counts every committed position; reply tokens per forward only the answer and its end-of-turn
  token (the positions after it, which complete the last block, are committed too but are not text).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import clover_lite
from clover_lite.quant.pipeline import QuantizeOptions, quantize_model
from clover_lite.runtime.engine import BUNDLED_MODEL, Engine
from clover_lite.training import corpus, tasks
from clover_lite.training.train import block_diffusion_forward, noise_blocks

# Run as a script, this folder comes first on sys.path, where bitsandbytes' optional `import kernels` (the
# Hugging Face kernels package) would find benchmarks/kernels.py instead: take the folder off.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

OUT = Path(__file__).parent / "out"
RATIOS = (0.15, 0.5, 1.0)
THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
WINDOW = 192
REPLY_CAP = {"interlocked": 128}  # tasks whose replies run past --max-new-tokens (three worked chains)


# ---- data ----------------------------------------------------------------------------------------
def heldout_text_windows(engine: Engine, n: int, length: int = WINDOW, seed: int = 0) -> torch.Tensor:
    """n windows of held-out stdlib text, from a deterministic spread of starting points."""
    _, held = corpus.split_files()
    ids = corpus.encode_corpus(_hf(engine), corpus.read_texts(held)).long()
    rng = random.Random(seed)
    starts = sorted(rng.randrange(len(ids) - length) for _ in range(n))
    return torch.stack([ids[s : s + length] for s in starts])


def heldout_task_windows(engine: Engine, n: int, length: int = WINDOW) -> tuple[torch.Tensor, torch.Tensor]:
    """n windows of packed held-out task chats (each window starts with a chat) and which positions are
    generated at inference (the reply and the rest of its last block): what the model is trained to fill
    in; prompts are never masked."""
    hf = _hf(engine)
    chats = [ex for i in range(tasks.HELDOUT_SIZE) for ex in (tasks.heldout(t)[i] for t in tasks.TASKS)]
    rows, masks, k = [], [], 0
    for _ in range(n):
        row: list[int] = []
        mask: list[bool] = []
        while len(row) < length:
            ids, reply = corpus.encode_chat(hf, chats[k % len(chats)])
            row += ids
            mask += reply
            k += 1
        rows.append(row[:length])
        masks.append(mask[:length])
    maskable = corpus.until_block_end(torch.tensor(masks, dtype=torch.bool), engine.config.block_size)
    return torch.tensor(rows, dtype=torch.long), maskable


def _hf(engine: Engine):
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(Path(engine.path) / "tokenizer.json"))


def unigram_logprobs(engine: Engine) -> dict[str, torch.Tensor]:
    """Add-one unigram log-probabilities of the training split, for text and for task chats (cached per
    tokenizer under benchmarks/out/, since tokenizing the training text takes a few seconds)."""
    tok_file = Path(engine.path) / "tokenizer.json"
    key = hashlib.sha1(tok_file.read_bytes()).hexdigest()[:12]
    cache = OUT / f"unigram-{key}.pt"
    if cache.exists():
        return torch.load(cache, weights_only=True)
    V = engine.config.vocab_size
    train_files, _ = corpus.split_files()
    hf = _hf(engine)
    text = corpus.encode_corpus(hf, corpus.read_texts(train_files)).long()
    rng = random.Random(1)
    replies = [corpus.encode_chat(hf, tasks.sample_train(rng)) for _ in range(5000)]
    task = torch.tensor([i for ids, reply in replies for i, r in zip(ids, reply, strict=True) if r])
    out = {}
    for name, ids in (("text", text), ("tasks", task)):
        counts = torch.bincount(ids, minlength=V).double() + 1.0
        out[name] = (counts / counts.sum()).log()
    OUT.mkdir(parents=True, exist_ok=True)
    torch.save(out, cache)
    return out


# ---- measurements --------------------------------------------------------------------------------
@torch.no_grad()
def masked_nll(
    engine: Engine,
    windows: torch.Tensor,
    ratio: float,
    unigram: torch.Tensor,
    maskable: torch.Tensor | None = None,
    seed: int = 0,
) -> dict:
    """Mean NLL (nats/token) of the masked positions, model and unigram, every block masked at `ratio`
    (of its `maskable` positions, default all)."""
    model, B = engine.model, engine.config.block_size
    gen = torch.Generator().manual_seed(seed)
    nll, uni, count = 0.0, 0.0, 0
    if maskable is None:
        maskable = torch.ones_like(windows, dtype=torch.bool)
    for chunk, allowed in zip(windows.split(8), maskable.split(8), strict=True):
        noisy, masked = noise_blocks(chunk, B, engine.mask_token_id, gen, ratio=ratio, maskable=allowed)
        hidden = block_diffusion_forward(model, chunk, noisy, B).hidden
        logits = model.logits(hidden[masked])
        target = chunk[masked]
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        uni -= float(unigram[target].sum())
        count += int(masked.sum())
    return {"model": nll / count, "unigram": uni / count, "masked_tokens": count,
            "masked_fraction": count / int(maskable.sum())}


def decode_settings(block_size: int, thresholds: Sequence[float]) -> list[tuple[str, dict]]:
    return [("1 per step", {"policy": "fixed", "steps_per_block": block_size})] + [
        (f"threshold {t:g}", {"policy": "threshold", "threshold": t}) for t in thresholds
    ]


def task_accuracy(engine: Engine, n: int, decoding: dict, max_new_tokens: int = 40) -> dict:
    """Accuracy per task on n held-out instances each (`tasks.is_correct`; `exact`: the whole reply), and
    tokens per forward overall."""
    acc, exact, committed, reply, forwards, eos, t0 = {}, {}, 0, 0, 0, 0, time.perf_counter()
    failures, by_steps = {}, {}
    for task in tasks.TASKS:
        right = same = 0
        for ex in tasks.eval_set(task, n):
            out = engine.generate([{"role": "user", "content": ex.prompt}], temperature=0.0,
                                  max_new_tokens=max(max_new_tokens, REPLY_CAP.get(task, 0)), **decoding)
            ok = tasks.is_correct(ex, out.text)
            right += ok
            same += out.text.strip() == ex.answer
            if task == "rules":  # [right, instances] by the rules the question sits behind
                counts = by_steps.setdefault(str(tasks.rule_steps(ex)), [0, 0])
                counts[0] += ok
                counts[1] += 1
            if not ok and task not in failures:
                failures[task] = {"prompt": ex.prompt, "answer": ex.answer, "got": out.text}
            eos += out.finish_reason == "eos"
            committed += out.stats.committed_tokens
            reply += out.stats.new_tokens + (out.finish_reason == "eos")  # the answer and its end of turn
            forwards += out.stats.forwards
        acc[task], exact[task] = right / n, same / n
    return {"accuracy": acc, "exact": exact, "mean_accuracy": sum(acc.values()) / len(acc),
            "tokens_per_forward": committed / max(forwards, 1), "forwards": forwards,
            # Without the positions after the end of turn that complete its block (committed, but not text).
            "reply_tokens_per_forward": reply / max(forwards, 1),
            "eos_rate": eos / (n * len(tasks.TASKS)), "seconds": time.perf_counter() - t0,
            "first_failure": failures, "rules_by_steps": dict(sorted(by_steps.items()))}


def _fact_lookup_right(ex: tasks.Example) -> bool:
    """Whether the shortcut "yes exactly when the asked atom is one of the facts" answers `ex` right: the
    baseline to beat besides guessing (it needs no rule)."""
    facts, _, asked = tasks.parse_rules(ex.prompt)
    return (asked in facts) == (ex.answer.split()[-1] == "yes")


def heldout_data(engine: Engine, n_windows: int) -> dict:
    """What the NLL rows need, a function of the tokenizer alone: the unigram and the held-out windows."""
    return {"unigram": unigram_logprobs(engine),
            "sets": {"text": (heldout_text_windows(engine, n_windows), None),
                     "task replies": heldout_task_windows(engine, n_windows)}}


def evaluate(
    engine: Engine,
    data: dict,
    n_task: int = 100,
    thresholds: Sequence[float] = THRESHOLDS,
    progress: Callable[[str], None] | None = None,
    max_new_tokens: int = 40,
) -> dict:
    """All measurements of one loaded model on `heldout_data` of its tokenizer."""
    say = progress or (lambda msg: None)
    files = list(Path(engine.path).glob("*.safetensors"))
    result: dict = {"model": str(engine.path), "weights_mb": sum(f.stat().st_size for f in files) / 1e6,
                    "block_size": engine.config.block_size, "nll": {}, "decoding": {},
                    # The rules baseline that needs no rule: a property of the questions, not of the model.
                    "rules_fact_lookup": sum(map(_fact_lookup_right, tasks.eval_set("rules", n_task))) / n_task}
    for name, (windows, maskable) in data["sets"].items():
        for r in RATIOS:
            say(f"NLL {name} ratio {r}")
            unigram = data["unigram"]["text" if name == "text" else "tasks"]
            result["nll"][f"{name}@{r:g}"] = masked_nll(engine, windows, r, unigram, maskable)
    for label, decoding in decode_settings(engine.config.block_size, thresholds):
        say(f"tasks, {label}")
        result["decoding"][label] = task_accuracy(engine, n_task, decoding, max_new_tokens)
    return result


# ---- report ----------------------------------------------------------------------------------------
def table(results: dict[str, dict]) -> str:
    lines = []
    for name, r in results.items():
        lines.append(f"## {name}  ({r['weights_mb']:.1f} MB, block size {r['block_size']})")
        lines.append("")
        lines.append("| held-out set @ mask ratio | masked | model NLL | unigram NLL |")
        lines.append("|---|---|---|---|")
        for key, v in r["nll"].items():
            lines.append(f"| {key} | {v['masked_fraction']:.2f} | {v['model']:.3f} | {v['unigram']:.3f} |")
        lines.append("")
        lines.append("| decoding | tokens/forward | reply tokens/forward | " + " | ".join(tasks.TASKS) + " | mean |")
        lines.append("|---|---|---|" + "---|" * (len(tasks.TASKS) + 1))
        for label, d in r["decoding"].items():
            accs = " | ".join(f"{100 * d['accuracy'][t]:.1f}" for t in tasks.TASKS)
            lines.append(f"| {label} | {d['tokens_per_forward']:.2f} | {d['reply_tokens_per_forward']:.2f} | {accs} | "
                         f"{100 * d['mean_accuracy']:.1f} |")
        lines.append("")
        for label, d in r["decoding"].items():
            split = ", ".join(f"{k}: {right}/{n}" for k, (right, n) in d["rules_by_steps"].items())
            lines.append(f"rules, {label}, by rules behind the question: {split}")
        lines.append(f"rules shortcut \"yes iff the asked atom is a fact\": {100 * r['rules_fact_lookup']:.0f}%")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, dict], out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install -e '.[plot]'); the JSON and the table have it all"
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        pts = sorted((d["tokens_per_forward"], 100 * d["mean_accuracy"], label) for label, d in r["decoding"].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=Path(name).name)
        for x, y, label in pts:
            ax.annotate(label.replace("threshold ", "t="), (x, y), fontsize=7)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("mean task accuracy (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return f"wrote {out}"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=None, help="model directories (default: the bundled model)")
    p.add_argument("--n-task", type=int, default=100, help="held-out instances per task")
    p.add_argument("--n-windows", type=int, default=32, help=f"held-out windows of {WINDOW} tokens per NLL set")
    p.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    p.add_argument("--max-new-tokens", type=int, default=40, help="reply length cap for the task accuracy")
    p.add_argument("--quant", nargs="*", default=[], choices=["rtn", "gptq", "nf4"],
                   help="also evaluate these 4-bit versions of the first model")
    p.add_argument("--group-size", type=int, default=64, help="quantization group size (--quant)")
    p.add_argument("--nsamples", type=int, default=64, help="calibration windows (--quant)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=str(OUT / "quality.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dirs = args.models or [str(BUNDLED_MODEL)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        named = [(d, d) for d in dirs]
        for method in args.quant:
            opts = QuantizeOptions(method=method, group_size=args.group_size, nsamples=args.nsamples,
                                   seqlen=WINDOW)
            print(f"[{dirs[0]}] quantizing: {method}, group {args.group_size}", file=sys.stderr, flush=True)
            report = quantize_model(dirs[0], Path(tmp) / method, opts)
            named.append((f"{dirs[0]} {method} g{args.group_size}", str(report.out)))
        data: dict[str, dict] = {}  # per tokenizer: each --models dir, shared by its 4-bit copies
        for name, d in named:
            engine = clover_lite.load(d, device="cpu")
            source = d if name in dirs else dirs[0]
            if source not in data:
                data[source] = heldout_data(engine, args.n_windows)
            results[name] = evaluate(engine, data[source], args.n_task, args.thresholds,
                                     progress=lambda msg, name=name: print(f"[{name}] {msg}", file=sys.stderr,
                                                                           flush=True),
                                     max_new_tokens=args.max_new_tokens)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    print(plot(results, out.with_suffix(".png")), file=sys.stderr)


if __name__ == "__main__":
    main()
