"""Joint decisions on held-out interlocked sets: several questions over one rule set, answered three ways.

    python benchmarks/decide.py                       # the bundled model, 200 sets of 3 questions
    python benchmarks/decide.py --model DIR --sets 50 --out /tmp/decide.json

Each set is a held-out `rules` instance of the bundled model's tasks (facts and conclusion-first rules,
clover_lite/training/tasks.py) with three questions over the same rules: the chain's last conclusion (yes),
the distractor rule's conclusion (no: its premise is never true) and one more atom of the prompt. The truth
comes from chaining the rules. Three ways to answer:

- joint: `Engine.decide(context, questions)`, all answers in the same denoising forwards;
- sequential: `Engine.decide(..., mode="sequential")`, one answer after another;
- one reply: one `generate` for the whole set with the `interlocked` task's prompt ("... questions: is X P?
  is Y Q? is Z R?"), a worked chain per question, one per line, each line's final yes/no parsed;
- free: one `generate` per question with the `rules` task's own prompt ("... question: is X P?"), its final
  yes/no parsed (`tasks.is_correct`).

Reported per way: the all-correct rate (every question of a set right), per-question accuracy, denoising
forwards per set and wall time per set; a table on stdout, JSON and, with matplotlib, a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out" / "decide.json"
WAYS = ("joint", "sequential", "one reply", "free")


def interlocked_sets(n: int, seed: int = 0) -> list[dict]:
    """`n` sets: context (facts and rules), the task-format prompt prefix, and three questions with truths."""
    from clover_lite.training.tasks import eval_set, parse_rules

    rng = random.Random(seed)
    out = []
    for ex in eval_set("rules", n):
        facts, premise, _ = parse_rules(ex.prompt)
        context = ex.prompt.split(" question: ")[0]
        concluded = sorted(premise)
        chain_end = next(b for b in concluded if holds(b, facts, premise))  # the chain's conclusion: yes
        distractor = next(b for b in concluded if not holds(b, facts, premise))  # its premise is false: no
        atoms = sorted({*facts, *premise, *premise.values()} - {chain_end, distractor})
        third = rng.choice(atoms)
        asked = [chain_end, distractor, third]
        rng.shuffle(asked)
        out.append({"context": context,
                    "questions": [(f"is {a.replace(' is ', ' ')}", ["yes", "no"]) for a in asked],
                    "truth": ["yes" if holds(a, facts, premise) else "no" for a in asked]})
    return out


def holds(atom: str, facts: list[str], premise: dict[str, str]) -> bool:
    """Whether an atom follows: chase the rule concluding it back to a fact (yes) or to nothing (no)."""
    while atom in premise:
        atom = premise[atom]
    return atom in facts


def run(engine, sets: list[dict]) -> dict[str, dict]:
    from clover_lite.training.tasks import Example, final_answers, interlocked_prompt, is_correct

    results = {}
    engine.decide(sets[0]["context"], sets[0]["questions"])  # warm-up: first calls pay one-time costs
    for way in WAYS:
        right = all_right = forwards = 0
        t0 = time.perf_counter()
        for s in sets:
            if way == "one reply":
                atoms = [name.removeprefix("is ").replace(" ", " is ", 1) for name, _ in s["questions"]]
                g = engine.generate(interlocked_prompt(s["context"], atoms), max_new_tokens=128)
                said = final_answers(g.text)
                answers = [said[k] if k < len(said) and len(said) == len(atoms) else "wrong" for k in range(len(atoms))]
                fw = g.stats.forwards
            elif way == "free":
                answers, fw = [], 0
                for (name, _), truth in zip(s["questions"], s["truth"], strict=True):
                    prompt = f"{s['context']} question: {name}?"
                    g = engine.generate(prompt)
                    answers.append(truth if is_correct(Example("rules", prompt, truth), g.text) else "wrong")
                    fw += g.stats.forwards
            else:
                d = engine.decide(s["context"], s["questions"], mode=way)
                answers, fw = [d.answers[name] for name, _ in s["questions"]], d.forwards
            ok = [a == t for a, t in zip(answers, s["truth"], strict=True)]
            right += sum(ok)
            all_right += all(ok)
            forwards += fw
        n = len(sets)
        results[way] = {"all_correct": all_right / n, "accuracy": right / (3 * n), "forwards_per_set": forwards / n,
                        "seconds_per_set": (time.perf_counter() - t0) / n}
    return results


def table(results: dict[str, dict], n: int) -> str:
    lines = [f"{n} interlocked sets of 3 questions", "",
             "| way | all correct | per question | forwards per set | ms per set |", "|---|---|---|---|---|"]
    for way, r in results.items():
        lines.append(f"| {way} | {100 * r['all_correct']:.1f}% | {100 * r['accuracy']:.1f}% | "
                     f"{r['forwards_per_set']:.1f} | {1000 * r['seconds_per_set']:.0f} |")
    return "\n".join(lines)


def plot(results: dict[str, dict], out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install -e '.[plot]'); the JSON and the table have it all"
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for way, r in results.items():
        ax.scatter(r["forwards_per_set"], 100 * r["all_correct"], label=way)
    ax.set_xlabel("denoising forwards per set")
    ax.set_ylabel("all correct (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return f"wrote {out}"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--sets", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    import clover_lite
    from clover_lite.checkpoint.output import check_file_target, write_text_atomic

    check_file_target(args.out)
    engine = clover_lite.load(args.model, device=args.device)
    sets = interlocked_sets(args.sets)
    results = run(engine, sets)
    print(table(results, len(sets)))
    write_text_atomic(args.out, json.dumps({"model": str(engine.path), "sets": len(sets), "results": results},
                                           indent=2))
    print(plot(results, args.out.with_suffix(".png")), file=sys.stderr)


if __name__ == "__main__":
    main()
