"""The benchmark scripts run (tiny sizes) and check what they claim, so they never rot."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .host_sync import HostSyncTrap

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_cache_benchmark_tokens_identical(tmp_path, monkeypatch):
    out = tmp_path / "cache.json"
    monkeypatch.setattr(sys, "argv", ["cache.py", "--prompt-lengths", "9", "40", "--new-tokens", "6",
                                      "--device", "cpu", "--json", str(out)])
    mod = runpy.run_path(str(BENCH / "cache.py"), run_name="bench")
    assert mod["main"]() == 0
    data = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in data["results"]] == [9, 40]
    assert all(r["identical_tokens"] and r["new_tokens"] == 6 for r in data["results"])


def test_quant_benchmark_table(tmp_path, monkeypatch, capsys):
    out = tmp_path / "quant.json"
    monkeypatch.setattr(sys, "argv", ["quant.py", "--model", str(_tiny(tmp_path)), "--methods", "rtn", "gptq",
                                      "--nsamples", "4", "--seqlen", "32", "--eval-samples", "16",
                                      "--eval-seqlen", "32", "--json", str(out)])
    mod = runpy.run_path(str(BENCH / "quant.py"), run_name="bench")
    assert mod["main"]() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["16-bit", "rtn", "gptq"]
    assert rows[1]["mib"] < rows[0]["mib"] / 2.5 and all(r["kl"] >= 0 for r in rows)
    assert "top-1" in capsys.readouterr().out


def _tiny(tmp_path):
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path / "tiny", seed=0)


def test_kernel_goals_judged_on_the_runtime_path():
    """Issue 4's goals from hand-made rows: only large shapes at M <= 16 count for bandwidth and 16-bit, every
    row with an NF4 time for NF4, and each reports its worst row."""
    goals = runpy.run_path(str(BENCH / "kernels.py"), run_name="bench")["goals"]

    def row(shape, K, N, M, bw, x16, nf4=None):
        return {"shape": shape, "K": K, "N": N, "M": M, "runtime_of_copy_bw": bw, "runtime_vs_16bit": x16,
                "runtime_vs_nf4": nf4}

    rows = [row("big", 2048, 4096, 1, 0.85, 3.6, 1.2), row("big", 2048, 4096, 16, 0.81, 3.5, 0.9),
            row("big", 2048, 4096, 32, 0.10, 0.5, 1.1),  # M > 16: not judged on bandwidth or 16-bit
            row("small", 2048, 512, 4, 0.05, 0.4)]  # under 8M weights: launch-bound, not judged; no NF4 time
    g = goals(rows)
    bw, x16, nf4 = g["copy_bandwidth_at_small_m"], g["vs_16bit_at_small_m"], g["vs_nf4_every_m"]
    assert (bw["met"], bw["rows"], bw["below"], bw["worst"], bw["worst_value"]) == (True, 2, 0, "big M=16", 0.81)
    assert (x16["met"], x16["worst_value"]) == (True, 3.5)  # the target itself counts as met
    assert (nf4["met"], nf4["rows"], nf4["below"], nf4["worst"]) == (False, 3, 1, "big M=16")
    rows[0]["runtime_of_copy_bw"] = 0.79
    assert goals(rows)["copy_bandwidth_at_small_m"]["met"] is False
    assert goals(rows[3:])["vs_nf4_every_m"]["met"] is None


def test_kernel_benchmark_smoke(tmp_path, monkeypatch):
    """The kernel benchmark runs end to end on the CPU (Triton interpreter, tiny shapes), so a GPU session finds
    it working; on the CPU it reports timings of the interpreter, which mean nothing. What the GPU run
    captures in a CUDA graph must never wait for the device: checked here on the calls themselves."""
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--smoke", "--out", str(tmp_path)])
    main = runpy.run_path(str(BENCH / "kernels.py"), run_name="bench")["main"]
    captured, saved = [], []

    def capture_on_cpu(calls, device, reps):  # stands in for graph_time's capture
        # Rows are saved as they are measured (a GPU run may be stopped at its time share): count them.
        js = tmp_path / "kernels.json"
        saved.append(len(json.loads(js.read_text())["dense"]) if js.exists() else 0)
        with HostSyncTrap():
            for call in calls[:2]:
                call()
        captured.append(len(calls))

    monkeypatch.setitem(main.__globals__, "graph_time", capture_on_cpu)
    assert main() == 0
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert {r["M"] for r in data["dense"]} == {1, 16} and data["moe"][0]["experts_touched"] >= 1
    # INT4, 16-bit and the MMA order per row, the unpacked and planes GEMMs at the table's config for M > 4, and
    # the MoE in both orders
    assert len(captured) == (3 * len(data["dense"]) + 2 * sum(r["M"] > 4 for r in data["dense"])
                             + 2 * len(data["moe"]))
    assert all(r["mma_s"] > 0 for r in data["dense"] + data["moe"])
    assert all((r["unpacked_tile_s"] is not None) == (r["M"] > 4) for r in data["dense"])
    assert all(r["weight_copies"] > 1 for r in data["dense"]) and data["moe"][0]["routings"] > 1  # rotated
    assert saved[0] == 0 and saved[-1] == len(data["dense"])  # the MoE timed with every dense row on disk
    # The tiny shape is in the MMA order, as the modules would hold it; it is too small for the goals.
    assert all(r["runtime_path"] == "mma" and r["runtime_s"] == r["mma_s"] for r in data["dense"])
    assert {g["met"] for g in data["goals"].values()} == {None}


@pytest.mark.unpoisoned
def test_gpu_check_runs_its_report_on_poisoned_memory(capsys):
    """gpu_check runs its divergence report outside pytest, so it poisons uninitialized memory itself, as the
    tests' conftest does: a kernel reading an element nobody wrote shows NaN there too; --no-poison opts out."""
    main = runpy.run_path(str(BENCH / "gpu_check.py"), run_name="bench")["main"]
    seen = []

    def reads_fresh_memory(device, gen, smoke):
        seen.append(bool(torch.empty(64).isnan().all()))
        return "read"

    main.__globals__["REPORTS"] = [("fresh memory", reads_fresh_memory)]
    empty = torch.empty
    assert main(["--smoke", "--no-bench"]) == 0 and seen == [True]
    assert "uninitialized memory poisoned" in capsys.readouterr().out
    assert torch.empty is empty  # restored after the checks, before the benchmarks
    main(["--smoke", "--no-bench", "--no-poison"])
    assert "torch.empty as it comes" in capsys.readouterr().out


def test_gpu_check_names_the_first_module_that_diverges(tmp_path):
    """When the kernels' logits miss the reference, gpu_check names the first module (in execution order) whose
    output differs: here one linear of layer 1 with a perturbed weight, not the modules after it."""
    import clover_lite

    first_divergence = runpy.run_path(str(BENCH / "gpu_check.py"), run_name="bench")["first_divergence"]
    src = _tiny(tmp_path)
    ref, test = (clover_lite.load(src, device="cpu", kernels="torch").model for _ in range(2))
    ids = torch.randint(0, ref.config.vocab_size, (1, 12))
    assert first_divergence(ref, test, ids, block_size=4).startswith("no module over")
    weight = test.layers[1].linear_attn.out_proj.weight
    with torch.no_grad():
        weight.add_(0.05 * torch.randn_like(weight))
    report = first_divergence(ref, test, ids, block_size=4)
    assert report.startswith("first module over 1e-03: layers.1.linear_attn.out_proj ("), report


def test_gpu_session_script_runs_the_kernel_tests_then_the_report(tmp_path):
    """The one command a GPU session runs (benchmarks/gpu_session.sh), as the device runs it, here in the
    interpreter (SESSION_DEVICE=interpret): the kernel tests through pytest (its arguments reach it intact: a
    session's device time is lost to a usage error), their count checked, then gpu_check.py's report; the logs
    land in $OUT/<mode>. Without a GPU, the default (--device cuda) stops at once with pytest's message."""
    env = {**os.environ, "OUT": str(tmp_path), "WORKERS": "0",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("TRITON_INTERPRET", None)  # conftest sets it from --device
    select = ["-k", "test_norm_at_the_models_widths"]
    for mode, switch, report in (("verified", "0", []), ("unverified", "1", ["--no-report"])):  # a folder each
        r = subprocess.run(["bash", str(BENCH / "gpu_session.sh"), mode, *select],
                           env={**env, "SESSION_DEVICE": "interpret", "GPU_CHECK_ARGS": " ".join(
                               ["--smoke", "--no-bench", *report])}, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        tests = (tmp_path / mode / "pytest.log").read_text()
        assert "1 kernel tests ran on interpret" in tests and "1 passed, " in tests, tests[-2000:]
        log = (tmp_path / mode / "gpu_check.log").read_text()
        assert ("ok  tiny model, kernels vs torch" in log) == (not report) and "error" not in log.lower(), log
        assert "modules compared" in log or report  # the divergence report
        machine = (tmp_path / mode / "machine.txt").read_text()
        assert "torch" in machine and f"kernels: {mode} (CLOVER_KERNELS_UNVERIFIED={switch})" in machine
    if not torch.cuda.is_available():
        r = subprocess.run(["bash", str(BENCH / "gpu_session.sh"), "verified", *select],
                           env={**env, "OUT": str(tmp_path / "no-gpu")}, capture_output=True, text=True, timeout=300)
        assert r.returncode == 4 and "--device cuda: no CUDA device here" in r.stdout, r.stdout[-2000:]
        assert not (tmp_path / "no-gpu" / "verified" / "gpu_check.log").exists()  # stopped before the report


def test_sweep_scores_every_candidate_against_the_tables_entry(tmp_path):
    """benchmarks/sweep.py end to end on the interpreter: each GEMM candidate is checked against the reference
    and timed on every shape, its score is the step's calls summed, and the table's entry is among them."""
    out = tmp_path / "sweep.json"
    r = subprocess.run([sys.executable, str(BENCH / "sweep.py"), "--smoke", "--no-moe", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (g,) = json.loads(out.read_text())["gemm"]
    assert len(g["results"]) == 3 and g["table_step_s"] is not None
    shapes = {"tiny a": 2, "tiny b": 1}
    for res in g["results"]:
        assert set(res["per_shape_s"]) == set(shapes)
        assert res["step_s"] == pytest.approx(sum(res["per_shape_s"][k] * n for k, n in shapes.items()))
    assert [x["step_s"] for x in g["results"]] == sorted(x["step_s"] for x in g["results"])
    assert "wrong result" not in r.stderr and "failed" not in r.stderr


def test_peak_allocations_replays_an_allocator_trace():
    """step.py --memory: the peak of what the traced allocations held, and which were live then, biggest first,
    each named by its first clover_lite frame; frees of blocks from before the trace are not counted."""
    peak_allocations = runpy.run_path(str(BENCH / "step.py"), run_name="bench")["peak_allocations"]

    def frame(name, line):
        return [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": f"/x/clover_lite/models/{name}.py", "line": line, "name": "forward"}]

    mib = 1 << 20
    trace = [{"action": "free_completed", "addr": 99, "size": 500 * mib},  # allocated before the trace
             {"action": "alloc", "addr": 1, "size": 100 * mib, "frames": frame("moe", 10)},
             {"action": "alloc", "addr": 2, "size": 300 * mib, "frames": frame("attention", 20)},
             {"action": "free_requested", "addr": 2, "size": 300 * mib},  # still held until completed
             {"action": "alloc", "addr": 3, "size": 50 * mib, "frames": []},
             {"action": "free_completed", "addr": 2, "size": 300 * mib},
             {"action": "alloc", "addr": 4, "size": 200 * mib, "frames": frame("gdn", 30)},
             {"action": "free_completed", "addr": 1, "size": 100 * mib}]
    peak, rows = peak_allocations(trace)
    assert peak == 450 * mib  # 100 + 300 + 50, before the 300 went back; 100 + 50 + 200 later is less
    assert [r["bytes"] for r in rows] == [300 * mib, 100 * mib, 50 * mib]
    assert rows[0]["where"] == "attention.py:20 forward" and rows[1]["where"] == "moe.py:10 forward"
    assert peak_allocations(trace, top=1)[1] == rows[:1] and peak_allocations([]) == (0, [])


def test_step_benchmark_runs(tmp_path, monkeypatch):
    """Rows for each context; every repetition starts from the prefilled state (a commit overwrites the
    GDN states in place, so putting back the length alone would let each repetition see a later state)."""
    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["step.py", "--contexts", "16", "40", "--reps", "3", "--json", str(out)])
    main = runpy.run_path(str(BENCH / "step.py"), run_name="bench")["main"]
    build, seen = main.__globals__["random_model"], {}

    def spying_model(*args, **kwargs):
        model = build(*args, **kwargs)
        commit = model.commit

        def spy(final, cache, block):
            states = [t.clone() for i in model.config.gdn_layers for t in cache.gdn_state(i)]
            seen.setdefault(cache.length, []).append(states)
            return commit(final, cache, block)

        model.commit = spy
        return model

    monkeypatch.setitem(main.__globals__, "random_model", spying_model)
    assert main() == 0
    # commits at length 0 are the prefills; at 16 and 40 the timed commits (3 reps; a CPU runs no warm-ups)
    assert sorted(seen) == [0, 16, 40] and len(seen[16]) == len(seen[40]) == 3
    for states in (seen[16], seen[40]):
        assert all(torch.equal(a, b) for later in states[1:] for a, b in zip(states[0], later, strict=True))
    rows = json.loads(out.read_text())["rows"]
    assert [r["context"] for r in rows] == [16, 40]
    for r in rows:
        assert r["step_ms"] > 0 and r["commit_ms"] > 0 and 0 <= r["outside_weight_reads"] <= 1
        assert r["attention_ms"] + r["GDN_ms"] + r["MoE_ms"] <= r["split_pass_ms"]  # parts of the pass timed
        assert r["prefill_peak_bytes"] is None and r["prefill_workspace_estimate_bytes"] > 0  # peak: CUDA only


def test_step_benchmark_through_the_kernels_and_the_static_step(tmp_path, monkeypatch):
    """The GPU configuration of the step benchmark (INT4, Triton kernels, the static step that a GPU captures
    as a CUDA graph), here with the interpreter and the static step run eagerly, on the tiny config cut to one
    GDN and one attention layer (every forward runs each kernel in the interpreter: seconds a layer)."""
    from clover_lite.checkpoint.tiny import tiny_config
    from clover_lite.planning import named_configs

    two = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    monkeypatch.setitem(named_configs.NAMED_CONFIGS, "tiny", lambda: tiny_config(**two))
    out = tmp_path / "step.json"
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    monkeypatch.setattr(sys, "argv", ["step.py", "--quant", "int4", "--contexts", "9", "--reps", "1",
                                      "--json", str(out), "--profile", "4"])
    assert runpy.run_path(str(BENCH / "step.py"), run_name="bench")["main"]() == 0
    data = json.loads(out.read_text())
    assert data["graph"] == "static step, eager"
    (r,) = data["rows"]
    assert r["layers"] == {"attention": 1, "GDN": 1}
    assert r["graph_step_ms"] > 0 and r["graph_commit_ms"] > 0 and 0 <= r["graph_outside_weight_reads"] <= 1
    # --profile: operators by self time (kernels on a GPU) for the static step and commit and the eager step
    profiles = json.loads(out.with_suffix(".profile.json").read_text())
    assert list(profiles) == ["step (static)", "commit (static)", "step (eager)"]
    assert all(p and p[0]["us"] >= p[-1]["us"] > 0 and p[0]["calls"] >= 1 for p in profiles.values())
    # the commit writes keys and values at the device-side length, which the step never does
    assert any("index_copy" in p["kernel"] for p in profiles["commit (static)"])
    assert not any("index_copy" in p["kernel"] for p in profiles["step (static)"])


def test_compile_check_describes_every_kernel_as_launched():
    """Every case of benchmarks/compile_check.py gives each of its kernel's constexprs a value, and each
    stride it specializes (unit, multiple of 16) is still some kernel's argument: the cheap half of the
    compile check (--sources-only: no compiler run), over every architecture and case. (Its own process:
    the script must import the kernels with the interpreter off.)"""
    import subprocess

    r = subprocess.run([sys.executable, str(BENCH / "compile_check.py"), "--sources-only"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    import re

    cases = int(re.search(r"(\d+) case\(s\)", r.stdout).group(1))
    assert cases > 100 and "; 0 failure(s)" in r.stdout, r.stdout


def test_kernels_compile_for_a_gpu_target():
    """The Triton compiler (no GPU needed) builds the heaviest kernel variants for sm_86, the architecture
    with the least shared memory, within its limit: what the interpreter cannot check (tl.dot shapes and
    types, register and shared-memory allocation). Compiled as launched (--as-run: unit strides constant,
    sizes multiples of 16), which is where the act-order GEMM once overran; the GEMV streams its weights
    in 16-byte loads, with a few dozen small loads per tile at most (it once gathered scales per element:
    150 or more). Neither INT4 kernel converts its weights from integers in the K loop (machine code: once
    1-1.6 conversions per weight, a cap of 44% of an H200's bandwidth; now a few per tile, for the zeros)."""
    import re
    import subprocess

    only = ["M<=16 moe gate/up", "gemv moe gate/up", "gdn block commit", "sampling sample", "attention D256 split"]
    cmd = [sys.executable, str(BENCH / "compile_check.py"), "--archs", "sm_86", "--quick", "--as-run", "--only", *only]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    # M <= 16 gate/up: planes, act-order, the MMA order (operands as they are and swapped); the GEMV in both orders
    assert r.stdout.count("ok   sm_86") == 9 and "gemm M<=16 moe gate/up mma swap:" in r.stdout
    lines = r.stdout.splitlines()

    def loop(ln):
        return tuple(map(int, re.search(r"loop (\d+) SASS instructions, (\d+) conv", ln).groups()))

    for order in ("", " mma"):
        gemv = next(ln for ln in lines if f"gemv moe gate/up{order}:" in ln)
        loads, wide = map(int, re.search(r"(\d+) global loads \((\d+) of 16 bytes\)", gemv).groups())
        assert wide >= 4 and loads <= 48, gemv  # words of gate and up; x's planes, scales, zeros (not per element)
        gemm = next(ln for ln in lines if f"gemm M<=16 moe gate/up{order}:" in ln)  # not the g_idx variant
        for ln in (gemm, gemv):  # fused gate/up: 2 x 64 x 128 weights per tile, 128 threads, so 128 per thread
            assert loop(ln)[1] <= 8 and loop(ln)[0] < 8 * 128, ln
    # The MMA order's point: its tile is the dot operand as built, fewer instructions than the nibble planes
    # (sm_86, Triton 3.9: 394 against 616).
    planes, mma = (next(ln for ln in lines if f"gemm M<=16 moe gate/up{o}:" in ln) for o in ("", " mma"))
    assert loop(mma)[0] < 0.8 * loop(planes)[0], (planes, mma)


def test_quality_benchmark_with_a_quantized_variant(tmp_path, capsys):
    """One model and its RTN version, tiny sizes: both get rows; one-token-per-step decoding commits exactly
    one token per forward; a random model's held-out NLL is close to the uniform ln(vocab)."""
    import math

    tiny = _tiny(tmp_path)
    out = tmp_path / "quality.json"
    mod = runpy.run_path(str(BENCH / "quality.py"), run_name="bench")
    mod["main"](["--models", str(tiny), "--quant", "rtn", "--group-size", "32", "--nsamples", "4",
                 "--n-task", "1", "--n-windows", "2", "--thresholds", "0.9", "--max-new-tokens", "8",
                 "--out", str(out)])
    data = json.loads(out.read_text())
    (name16, r16), (name4, r4) = data.items()
    assert name4 == f"{tiny} rtn g32" and r4["weights_mb"] < r16["weights_mb"] / 2
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    for r in (r16, r4):
        assert set(r["decoding"]) == {"1 per step", "threshold 0.9"}
        assert r["decoding"]["1 per step"]["tokens_per_forward"] == 1.0
        assert r["decoding"]["threshold 0.9"]["tokens_per_forward"] >= 1.0
        assert all(0 < d["reply_tokens_per_forward"] <= d["tokens_per_forward"] for d in r["decoding"].values())
        assert abs(r["nll"]["text@1"]["model"] - math.log(vocab)) < 0.5
    printed = capsys.readouterr().out
    assert "| decoding | tokens/forward |" in printed and "rules, 1 per step, by rules behind the question: " in printed
    one = r16["decoding"]["1 per step"]
    assert sum(n for _, n in one["rules_by_steps"].values()) == 1  # --n-task 1
    assert sum(right for right, _ in one["rules_by_steps"].values()) == one["accuracy"]["rules"]  # 0 or 1 right


def test_quality_fact_lookup_shortcut_by_hand():
    """The baseline "yes exactly when the asked atom is a fact", on hand-written instances."""
    from clover_lite.training.tasks import Example

    right = runpy.run_path(str(BENCH / "quality.py"), run_name="bench")["_fact_lookup_right"]
    rules = " rules: Bob is big if Ann is red. Dan is shy if Cal is old."
    fact = Example("rules", "facts: Eve is tall. Ann is red." + rules + " question: is Ann red?",
                   "Ann is red is given. yes")
    derived = Example("rules", "facts: Ann is red." + rules + " question: is Bob big?",
                      "Bob is big if Ann is red. Ann is red is given. yes")
    unsupported = Example("rules", "facts: Ann is red." + rules + " question: is Dan shy?",
                          "Dan is shy if Cal is old. Cal is old is unknown. no")
    near = Example("rules", "facts: Ann is red." + rules + " question: is Ann old?", "Ann is old is unknown. no")
    assert right(fact) and not right(derived) and right(unsupported) and right(near)


def test_rules_probe_finds_every_premise_copy(tmp_path):
    """One probe per " if" of the replies (counted here from the answer text), each at the premise's person;
    the bundled model copies them all; head weights are shares of a softmax row."""
    from clover_lite.training import tasks

    probe = runpy.run_path(str(BENCH / "rules_probe.py"), run_name="bench")
    out = tmp_path / "probe.json"
    assert probe["main"](["--n", "4", "--heads", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    behind = [ex for ex in tasks.heldout("rules") if " if " in ex.answer][:4]
    assert data["rules"]["probes"] == sum(ex.answer.count(" if ") for ex in behind)
    assert data["rules"]["right"] == data["rules"]["probes"] and data["cite"]["probes"] >= 2 * 3
    heads = data["rules"]["heads"]
    assert len(heads) == 16 and all(0 <= w["right"] and w["right"] + w["other rules"] <= 1 + 1e-6
                                    for w in heads.values())


@pytest.mark.unpoisoned
def test_launch_count_of_a_step_has_no_elementwise_glue_in_the_layers():
    """benchmarks/launches.py: on the Triton path a step's GDN, attention and MoE layers issue torch operators
    only for their unquantized matmuls (GDN a/b, the router with the shared expert's gate); every other
    operation, the decoder's residual adds included, is inside a Triton kernel. Before the glue kernels the
    tiny model's step issued 120 torch operators (docs/journal/2026-12.md)."""
    script = runpy.run_path(str(BENCH / "launches.py"), run_name="bench")
    r = script["count_step"]()
    assert r["triton_launches"] > 0 and r["triton"]["_gdn_prep_kernel"] == 1
    layers = [row for row in r["torch"] if row["line"].startswith(("models/gdn.py", "models/moe.py",
                                                                    "models/attention.py", "kernels/"))]
    assert {row["op"] for row in layers} <= {"mm"}, layers
    assert sum(row["calls"] for row in layers) <= 3, layers
    adds = [row for row in r["torch"] if row["line"].startswith("models/") and row["op"] == "add"]
    assert not adds, adds
    # The host-time probe stubs the INT4 launches and puts them back.
    from clover_lite.kernels import int4_gemm

    kernel = int4_gemm._gemm_kernel
    host = script["host_time"](reps=1, calls=3)
    assert len(host) == 4 and all(v > 0 for v in host.values()) and int4_gemm._gemm_kernel is kernel


def test_host_overhead_benchmark_table(tmp_path, monkeypatch, capsys):
    """benchmarks/host_overhead.py at tiny sizes: a row per size with each variant timed, one token committed per
    step, and the incremental text identical to the full re-decode's."""
    out = tmp_path / "host.json"
    monkeypatch.setattr(sys, "argv", ["host_overhead.py", "--new-tokens", "8", "30", "--repeats", "1",
                                      "--stop", "\x00never", "--json", str(out)])
    assert runpy.run_path(str(BENCH / "host_overhead.py"), run_name="bench")["main"]() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["new_tokens"] for r in rows] == [8, 30] and all(r["identical_text"] for r in rows)
    for r in rows:
        for v in ("incremental", "no decode", "full re-decode"):
            assert r[v]["ms_per_step"] > 0 and r[v]["steps"] == r["new_tokens"] and r[v]["finish"] == "length"
    assert "full re-decode" in capsys.readouterr().out


def test_decide_benchmark_sets_and_table(tmp_path, capsys):
    """benchmarks/decide.py: each interlocked set asks three questions over one rule set whose truths follow
    from chaining its rules (checked here independently: the chain's conclusion yes, the distractor's no); the
    run reports every way, with all-correct never above per-question accuracy."""
    mod = runpy.run_path(str(BENCH / "decide.py"), run_name="bench")
    from clover_lite.training.tasks import parse_rules

    sets = mod["interlocked_sets"](4, seed=1)
    for s in sets:
        assert len(s["questions"]) == 3 and sorted(s["truth"]).count("yes") >= 1 and "no" in s["truth"]
        facts, premise, _ = parse_rules(s["context"] + " question: is Ann red?")
        for (name, options), truth in zip(s["questions"], s["truth"], strict=True):
            person, prop = name.removeprefix("is ").split()
            atom, seen = f"{person} is {prop}", 0
            while atom in premise and seen < 10:
                atom, seen = premise[atom], seen + 1
            assert truth == ("yes" if atom in facts else "no") and options == ["yes", "no"]
    out = tmp_path / "d.json"
    mod["main"](["--sets", "2", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"joint", "sequential", "one reply", "free"}
    for r in results.values():
        assert 0 <= r["all_correct"] <= r["accuracy"] <= 1 and r["forwards_per_set"] >= 1
    assert "| joint |" in capsys.readouterr().out
