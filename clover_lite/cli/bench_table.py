"""What `clover bench`'s two runs (block denoisers, cli/bench.py; DiffusionGemma, cli/bench_diffusion_gemma.py)
share: the latency summary and the report's timing rows."""

from __future__ import annotations

import statistics

from clover_lite.planning.devices import fmt_bytes


def latency_summary(seconds: list[float]) -> dict:
    s = sorted(seconds)
    return {"median_ms": 1e3 * statistics.median(s), "min_ms": 1e3 * s[0],
            "p90_ms": 1e3 * s[min(len(s) - 1, int(0.9 * len(s)))], "n": len(s)}


def report_table(r: dict, setup: str, generation: str, labels: tuple[str, str], per: tuple[str, str]):
    """The report as a rich Table: the `setup` and `generation` lines, then the step and commit latencies
    (`labels`), prefill, peak memory and the projection of tokens/s by `per` (its label, and the projection
    entries' key for it: tokens per forward, steps per canvas)."""
    from rich.table import Table

    table = Table(title=f"clover bench: {r['model']}", show_header=False)
    table.add_row("setup", setup)
    table.add_row("generation", generation)
    for key, label in zip(("step", "commit"), labels, strict=True):
        s = r[key]
        table.add_row(label, f"{s['median_ms']:.2f} ms median (min {s['min_ms']:.2f}, p90 {s['p90_ms']:.2f}, "
                             f"n {s['n']})")
    p = r["prefill"]
    table.add_row("prefill", f"{p['tokens_per_second']:.0f} tok/s ({p['tokens']} tokens in {p['seconds']:.3f} s)")
    table.add_row("peak memory", f"{fmt_bytes(r['peak_memory_bytes'])} ({r['peak_memory_kind']}); planned "
                                 f"{fmt_bytes(r['plan']['total_bytes'])}")
    label, key = per
    proj = ", ".join(f"{x[key]}: {x['tokens_per_second']:.0f}" for x in r["projection"])
    table.add_row(f"tok/s at k {label}", proj + "  (from the median step and commit latencies)")
    return table
