"""One denoising step and one commit, at several context lengths, split by component.

A model with random weights is built on the device (no download): the Clover-35B-A3B config in INT4 on a
GPU, the tiny config on a CPU. For each context length the cache is filled to that length, then a step
(the block's masked positions -> logits -> tokens) and a commit are timed; the time of each component
(attention, GDN, MoE) is taken by hooks around the modules in passes of their own, lm_head + sampling in
the step. The weight-read floor is the bytes a step must read (every non-expert weight, the experts a
block touches, the lm_head, the KV cache) over the measured copy bandwidth; "outside weight reads" is the
part of the step above that floor.

    python benchmarks/step.py                                # GPU: clover-35b-a3b int4 at 1K, 8K, 32K
    python benchmarks/step.py --config tiny --contexts 64 256 --json out.json
With the Triton kernels the step is also timed through the static step (graph.StaticStep), captured as a
CUDA graph on a GPU: the "graph ms" column. "outside" is the share of the eager step above the
weight-read floor, "graph out" the same for the graph step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from clover_lite.cli.bench import random_model
from clover_lite.kernels import dispatch
from clover_lite.models.attention import GatedAttention
from clover_lite.models.gdn import GatedDeltaNet
from clover_lite.models.moe import SparseMoE
from clover_lite.planning import memory, named_configs, planner

COMPONENTS = ("attention", "GDN", "MoE")
PREFILL_CHUNK = planner.PREFILL_CHUNK


class ComponentTimer:
    """Wall time per module kind, summed over a forward (CUDA events on a GPU)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device, self.spans, self.handles = device, {k: [] for k in COMPONENTS}, []
        kinds = {GatedAttention: "attention", GatedDeltaNet: "GDN", SparseMoE: "MoE"}
        for m in model.modules():
            kind = next((v for k, v in kinds.items() if isinstance(m, k)), None)
            if kind:
                self.handles.append(m.register_forward_pre_hook(self._start(kind)))
                self.handles.append(m.register_forward_hook(self._stop(kind)))
        self.open: dict[str, object] = {}

    def _now(self):
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _start(self, kind):
        return lambda m, args: self.open.__setitem__(kind, self._now())

    def _stop(self, kind):
        return lambda m, args, out: self.spans[kind].append((self.open[kind], self._now()))

    def totals(self) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            out = {k: sum(a.elapsed_time(b) / 1e3 for a, b in v) for k, v in self.spans.items()}
        else:
            out = {k: sum(b - a for a, b in v) for k, v in self.spans.items()}
        for v in self.spans.values():
            v.clear()
        return out

    def close(self):
        for h in self.handles:
            h.remove()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_read_bytes(config, quant: str, block: int, context: int, dtype: str) -> int:
    """Bytes one step must read: weights (only the experts a block of `block` tokens touches), lm_head
    (for the masked rows), the KV cache at `context` and the GDN state."""
    cats = memory.weight_bytes(config, memory.parse_quant(quant), dtype)
    per = {k: sum(v.values()) for k, v in cats.items()}
    E, k = config.num_experts, config.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** block) if E else 0
    experts = per.pop("routed experts", 0) * (touched / E if E else 0)
    per.pop("embeddings", None)  # a step reads only B rows of it
    return int(sum(per.values()) + experts + memory.kv_bytes_per_token(config, dtype) * context
               + memory.gdn_state_bytes(config, dtype))


def copy_bandwidth(device: torch.device) -> float:
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    a, b = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    return 2 * n * 10 / (time.perf_counter() - t)


@torch.no_grad()
def time_phases(phases: list, reps: int, warm: int, device, after=None) -> list[list[float]]:
    """Seconds of each phase, run in turn, per repetition (the device synced at every boundary), after `warm`
    untimed repetitions; `after` runs untimed after each repetition."""
    times: list[list[float]] = [[] for _ in phases]
    for i in range(reps + warm):
        sync(device)
        for spans, phase in zip(times, phases, strict=True):
            t0 = time.perf_counter()
            phase()
            sync(device)
            if i >= warm:
                spans.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return times


def measure(model, cache, static, context: int, block: int, mask_id: int, reps: int, device,
            memory: bool = False) -> dict:
    c = model.config
    gen = torch.Generator().manual_seed(context)
    ids = torch.randint(0, mask_id, (1, context), generator=gen).to(device)
    cache.reset()
    if device.type == "cuda":  # the prefill's transient memory, against the planner's estimate (main)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    if memory and device.type == "cuda":  # what the prefill's peak is made of (the planner's estimate, main)
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=1_000_000)
    model.prefill(ids, cache, block, chunk_tokens=PREFILL_CHUNK)
    prefill_peak = torch.cuda.max_memory_allocated(device) - held if device.type == "cuda" else None
    prefill_memory = None
    if memory and device.type == "cuda":
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
        torch.cuda.memory._record_memory_history(enabled=None)
        traced_peak, largest = peak_allocations(trace)
        prefill_memory = {"traced_peak_bytes": traced_peak, "largest_at_peak": largest}
    masked = torch.full((1, block), mask_id, device=device)
    positions = torch.arange(block, device=device)
    final = torch.randint(0, mask_id, (1, block), generator=gen).to(device)
    chooser = dispatch.chooser(getattr(model, "backend", "torch"))  # what the engine samples with
    # A commit advances the length and overwrites the GDN states in place: both are put back after each,
    # outside the timed spans, so every repetition (and the graph column) starts from the prefilled state.
    length = cache.length
    states = {i: tuple(t.clone() for t in cache.gdn_state(i)) for i in c.gdn_layers}

    def undo_commit():
        cache.length = length
        for i, (recurrent, conv) in states.items():
            cache.recurrent[i].copy_(recurrent)
            cache.conv[i].copy_(conv)

    # Warm-ups on a GPU (Triton compiles, cuBLAS picks its kernels, the allocator grows); a CPU has nothing to
    # warm, and under the interpreter a tiny model's forward takes seconds.
    warm = 2 if device.type == "cuda" else 0
    hidden = {}

    def run():
        hidden["h"] = model._run(masked, cache.length, None, cache, need_states=False)[0]

    def head():
        chooser(model.logits(hidden["h"][:, positions])[0], confidence="prob", banned_token_id=mask_id)

    runs, heads, commits = time_phases([run, head, lambda: model.commit(final, cache, block)], reps, warm, device,
                                       after=undo_commit)
    steps = [a + b for a, b in zip(runs, heads, strict=True)]
    # The split by component in passes of its own: the hooks record events on the host, time that would
    # add to a launch-bound step (about 160 events a step at Clover).
    timer = ComponentTimer(model, device)
    parts, hooked = [], []
    for i in range(reps + min(warm, 1)):
        sync(device)
        t0 = time.perf_counter()
        model._run(masked, cache.length, None, cache, need_states=False)
        sync(device)
        t1 = time.perf_counter()
        comp = timer.totals()
        if i >= min(warm, 1):
            parts.append(comp)
            hooked.append(t1 - t0)
    timer.close()
    graph, graph_commits = [], []
    if static is not None:  # the same step and commit through the static (CUDA-graph) path
        graph, graph_commits = time_phases(
            [lambda: chooser(static(masked)[0, positions], confidence="prob", banned_token_id=mask_id),
             lambda: static.commit(final)], reps, warm, device, after=undo_commit)
    med = statistics.median
    return {
        "context": context, "step_ms": 1e3 * med(steps), "commit_ms": 1e3 * med(commits),
        "graph_step_ms": 1e3 * med(graph) if graph else None,
        "graph_commit_ms": 1e3 * med(graph_commits) if graph_commits else None,
        **{f"{k}_ms": 1e3 * med(p[k] for p in parts) for k in COMPONENTS},
        "lm_head_sampling_ms": 1e3 * med(heads),
        "prefill_peak_bytes": prefill_peak,
        "prefill_memory": prefill_memory,
        "split_pass_ms": 1e3 * med(hooked),  # the forward the components were timed in (without the head)
        "layers": {k: sum(1 for t in c.layer_types if (t == "full_attention") == (k == "attention"))
                   for k in ("attention", "GDN")},
    }


def peak_allocations(trace: list[dict], top: int = 12) -> tuple[int, list[dict]]:
    """Replays a CUDA allocator trace (torch.cuda.memory._snapshot()["device_traces"][i]: alloc and
    free_completed events with address, size and Python frames): the most bytes that allocations made during
    the trace held at once, and the largest of them live at that moment, each with the first clover_lite
    frame that made it. Blocks allocated before the trace began are not counted."""
    live: dict[int, dict] = {}
    held = peak = 0
    at_peak: list[dict] = []
    for ev in trace:
        if ev.get("action") == "alloc":
            live[ev["addr"]] = ev
            held += ev["size"]
            if held > peak:
                peak, at_peak = held, list(live.values())
        elif ev.get("action") == "free_completed" and ev.get("addr") in live:
            held -= live.pop(ev["addr"])["size"]
    rows = []
    for ev in sorted(at_peak, key=lambda e: -e["size"])[:top]:
        frames = ev.get("frames") or []
        ours = next((f for f in frames if "clover_lite" in f.get("filename", "")), frames[0] if frames else {})
        where = f"{Path(ours.get('filename', '?')).name}:{ours.get('line', '?')} {ours.get('name', '')}".strip()
        rows.append({"bytes": ev["size"], "where": where})
    return peak, rows


def kernel_profile(fn, device: torch.device) -> list[dict]:
    """GPU time per kernel over one call of fn (torch.profiler's CUDA activity; a graph replay's kernels are
    listed one by one), most time first: what a step spends where, launch gaps excluded. On a CPU, the
    self time of each operator."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    if gpu:  # a warm-up (compilation, autotuning); the interpreter has nothing to warm
        fn()
        sync(device)
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        fn()
        sync(device)
    field = "self_device_time_total" if gpu else "self_cpu_time_total"
    rows = [{"kernel": e.key, "calls": e.count, "us": getattr(e, field)}
            for e in prof.key_averages() if getattr(e, field, 0) > 0]
    return sorted(rows, key=lambda r: -r["us"])


def print_profile(title: str, rows: list[dict], top: int) -> None:
    total = sum(r["us"] for r in rows)
    calls = sum(r["calls"] for r in rows)
    print(f"\n{title}: {calls} kernels, {total / 1e3:.2f} ms of device time")
    print(f"{'us':>9} {'share':>6} {'calls':>6} {'us/call':>8}  kernel")
    for r in rows[:top]:
        print(f"{r['us']:>9.0f} {100 * r['us'] / total:>5.1f}% {r['calls']:>6} {r['us'] / r['calls']:>8.1f}  "
              f"{r['kernel'][:90]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="named config (default: clover-35b-a3b on a GPU, tiny on CPU)")
    ap.add_argument("--quant", default=None, help="int4 | bf16 (default: int4 on a GPU, fp32 on CPU)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--memory", action="store_true",
                    help="CUDA: record the allocator during each prefill and list the largest allocations live at "
                         "its peak, with the line that made each (slower prefill)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the table, the N kernels taking most device time in one static step, one static "
                         "commit (CUDA graphs on a GPU) and one eager step, at the last context")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    name = args.config or ("clover-35b-a3b" if gpu else "tiny")
    quant = args.quant or ("int4" if gpu else "fp32")
    contexts = args.contexts or ([1024, 8192, 32768] if gpu else [64, 256])
    config = named_configs.named_config(name)
    block = args.block_size or config.block_size or 32
    dtype = torch.bfloat16 if gpu else torch.float32
    model = random_model(config, quant, device, dtype)
    mask_id = config.mask_token_id if config.mask_token_id is not None else config.vocab_size - 1
    bw = copy_bandwidth(device)
    card = torch.cuda.get_device_name(device) if gpu else "cpu"
    cache = model.new_cache(capacity=max(contexts) + block)
    static = None
    from clover_lite.runtime.graph import StaticStep

    if StaticStep.supported(model, block) is None:
        static = StaticStep(model, cache, block)
        if gpu:
            static.capture()
    mode = "CUDA graph" if static is not None and static.graph is not None else (
        "static step, eager" if static is not None else f"none ({StaticStep.supported(model, block)})")
    print(f"{name} ({quant}) on {card}, block {block}, copy bandwidth {bw / 1e9:.0f} GB/s; graph column: {mode}")
    print(f"{'context':>8} {'step ms':>8} {'graph ms':>9} {'commit ms':>10} {'graph cm':>9} {'attn':>7} {'GDN':>7} "
          f"{'MoE':>7} {'head+samp':>10} {'floor ms':>9} {'outside':>8} {'graph out':>9}", flush=True)
    rows = []
    for n in contexts:  # each row printed and saved as it is measured: a run stopped early keeps what it did
        r = measure(model, cache, static, n, block, mask_id, args.reps, device, memory=args.memory)
        floor = weight_read_bytes(config, quant, block, n, "bf16" if gpu else "fp32") / bw
        r["weight_floor_ms"] = 1e3 * floor
        r["prefill_workspace_estimate_bytes"] = memory.workspace_bytes(
            config, memory.parse_quant(quant), "bf16" if gpu else "fp32", min(PREFILL_CHUNK, n), n, step=False,
            backend=getattr(model, "backend", "torch"))
        r["outside_weight_reads"] = max(0.0, 1 - floor / (r["step_ms"] / 1e3))
        g = r["graph_step_ms"]
        r["graph_outside_weight_reads"] = None if g is None else max(0.0, 1 - floor / (g / 1e3))
        rows.append(r)
        graph = f"{g:>9.2f}" if g is not None else f"{'-':>9}"
        gc = r["graph_commit_ms"]
        graph_commit = f"{gc:>9.2f}" if gc is not None else f"{'-':>9}"
        g_out = r["graph_outside_weight_reads"]
        g_out = f"{100 * g_out:>8.0f}%" if g_out is not None else f"{'-':>9}"
        print(f"{r['context']:>8} {r['step_ms']:>8.2f} {graph} {r['commit_ms']:>10.2f} {graph_commit} "
              f"{r['attention_ms']:>7.2f} {r['GDN_ms']:>7.2f} {r['MoE_ms']:>7.2f} {r['lm_head_sampling_ms']:>10.2f} "
              f"{r['weight_floor_ms']:>9.3f} "
              f"{100 * r['outside_weight_reads']:>7.0f}% {g_out}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"config": name, "quant": quant, "card": card, "block": block,
                                                   "copy_GBps": bw / 1e9, "graph": mode, "rows": rows}, indent=2))
    if args.profile:
        masked = torch.full((1, block), mask_id, device=device)
        final = torch.randint(0, mask_id, (1, block), device=device)
        profiles = {}
        with torch.no_grad():
            if static is not None:
                profiles["step (static)"] = kernel_profile(lambda: static(masked), device)
                length = cache.length

                def commit_and_undo():  # the GDN states it overwrites are irrelevant to the timing
                    static.commit(final)
                    cache.length = length

                profiles["commit (static)"] = kernel_profile(commit_and_undo, device)
            profiles["step (eager)"] = kernel_profile(
                lambda: model.logits(model._run(masked, cache.length, None, cache, need_states=False)[0]), device)
        for title, prof in profiles.items():
            print_profile(f"{title} at context {cache.length}", prof, args.profile)
        if args.json:
            Path(args.json).with_suffix(".profile.json").write_text(json.dumps(profiles, indent=2))
    for r in rows:
        if r["prefill_peak_bytes"] is not None:
            print(f"prefill to {r['context']}: transient peak {r['prefill_peak_bytes'] / 2**30:.2f} GiB, planner's "
                  f"estimate {r['prefill_workspace_estimate_bytes'] / 2**30:.2f} GiB")
            mem = r.get("prefill_memory")
            if mem:
                print(f"  allocations made during it: {mem['traced_peak_bytes'] / 2**30:.2f} GiB at their peak; "
                      "the largest then:")
                for a in mem["largest_at_peak"]:
                    print(f"  {a['bytes'] / 2**20:>10.1f} MiB  {a['where']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
