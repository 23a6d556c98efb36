"""A whole generation with every Triton kernel (attention, GDN, sampling; INT4 GEMM and MoE for a
quantized model), run by the interpreter, gives the reference path's greedy tokens."""

import pytest
import torch

pytest.importorskip("triton")

import clover_lite  # noqa: E402
from clover_lite.kernels import dispatch  # noqa: E402

from .host_sync import HostSyncTrap, LaunchRecorder, first_difference  # noqa: E402


def test_host_sync_trap_catches_syncs():
    x = torch.randn(6)
    for op in (lambda: x.sum().item(), lambda: int(x.argmax()), lambda: bool(x[0] > 0), lambda: x[x > 0],
               lambda: torch.nonzero(x), lambda: torch.bincount(x.long().abs()), lambda: torch.unique(x)):
        with pytest.raises(AssertionError, match="waits for the device"), HostSyncTrap():
            op()
    with HostSyncTrap():  # what a captured step may do
        torch.topk(x, 2), x[torch.tensor([1, 3])], torch.argsort(x), x.clone().index_put_((torch.tensor([0]),), x[:1])


def test_launch_recorder_sees_what_a_graph_would_freeze():
    """Two runs record equal launches only if every grid, scalar and tensor layout a graph would freeze is
    the same: here an RMSNorm kernel's eps (a host value) and a sliced input's shape, and a persistent weight
    told from a temporary."""
    from clover_lite.kernels.norm import rms_norm

    x, w = torch.randn(6, 32), torch.randn(32)

    def record(eps: float, rows: int, weight: torch.Tensor) -> list:
        with LaunchRecorder({w.untyped_storage().data_ptr(): "w"}) as rec:
            rms_norm(x[:rows], weight, eps)
        return rec.launches

    base = record(1e-6, 6, w)
    assert any(launch[0] == "_rms_norm_kernel" for launch in base)
    assert first_difference(base, record(1e-6, 6, w)) is None
    for other in (record(1e-5, 6, w), record(1e-6, 5, w), record(1e-6, 6, w.clone())):
        assert first_difference(base, other) is not None


def _persistent_buffers(engine) -> dict[int, str]:
    """Storage address -> name of what a captured step reads in place: the model's parameters and buffers,
    the cache's tensors and the static step's input buffers."""
    named = dict(engine.model.named_parameters())
    named.update(engine.model.named_buffers())
    for field in ("keys", "values", "recurrent", "conv"):
        named.update({f"cache.{field}[{i}]": t for i, t in enumerate(getattr(engine._cache, field)) if t is not None})
    s = engine._static
    named.update({"static.ids": s.ids, "static.length": s.length, "static.offsets": s.offsets})
    return {t.untyped_storage().data_ptr(): name for name, t in named.items()}


def _pair(path):
    ref = clover_lite.load(path, device="cpu")
    tri = clover_lite.load(path, device="cpu")
    dispatch.apply(tri.model, "triton")
    return ref, tri


def test_float_model_kernels_match_reference(tiny2_dir):
    ref, tri = _pair(tiny2_dir)
    prompt = [3, 1, 4, 1, 5, 9, 2]  # a partial block first: the prompt's tail joins the first generated block
    kw = dict(max_new_tokens=10, threshold=0.006)  # several positions per step
    a, b = ref.generate(prompt, **kw), tri.generate(prompt, **kw)
    assert a.token_ids == b.token_ids and a.stats.forwards == b.stats.forwards
    with torch.no_grad():  # a step's logits against the cache, kernels vs reference
        for engine in (ref, tri):
            cache = engine.model.new_cache()
            engine.model.prefill(torch.tensor([prompt[:4]]), cache, 4)
            engine.logits, _ = engine.model.step(torch.tensor([[7, 259, 8, 259]]), cache)
    torch.testing.assert_close(tri.logits, ref.logits, atol=1e-4, rtol=1e-4)


def test_sampling_with_kernels_is_seeded(tiny2_dir):
    _, tri = _pair(tiny2_dir)
    kw = dict(max_new_tokens=6, temperature=1.0, seed=11)
    assert tri.generate([1, 2, 3], **kw).token_ids == tri.generate([1, 2, 3], **kw).token_ids


def _as_on_gpu(monkeypatch, arch: str) -> None:
    """Every kernel launcher takes what it would on the named GPU with 132 SMs (its table's tiles, split-K
    filling the SMs, the MoE GEMV's entry), still run by the interpreter."""
    from clover_lite.kernels import attention, int4_launch

    monkeypatch.setattr(int4_launch, "device_arch", lambda device: arch)
    monkeypatch.setattr(attention, "_arch", lambda device: arch)
    monkeypatch.setattr(int4_launch, "sm_count", lambda index: 132)
    monkeypatch.setattr(attention, "_sm_count", lambda device: 132)


@pytest.mark.parametrize("arch", [None, "sm_90"])
def test_static_step_equals_the_step_and_generation(tiny2_dir, tmp_path, monkeypatch, arch):
    """The CUDA-graph step and commit (static shapes, cache length read on the device) run eagerly here, with
    the interpreter's configs and with an H200's (`arch`): the
    step's logits equal the dynamic step's at several cache lengths, the commit leaves the cache as the
    reference commit does, neither waits for the device (which capture forbids) nor launches anything at one
    cache length that it does not launch alike at the other (a graph captured at one replays at every
    length), and a generation through them equals the reference's."""
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model
    from clover_lite.runtime.graph import StaticStep

    q = quantize_model(tiny2_dir, tmp_path / "q", QuantizeOptions(group_size=32, nsamples=4, seqlen=32)).out
    if arch:
        _as_on_gpu(monkeypatch, arch)
    ref = clover_lite.load(q, device="cpu")
    eng = clover_lite.load(q, device="cpu", kernels="triton", static_step=True, context=64)
    assert isinstance(eng._static, StaticStep) and eng._static.num_splits >= 1
    gen = torch.Generator().manual_seed(3)
    persistent = _persistent_buffers(eng)
    recorded = []  # per cache length: the step's launches, then the commit's
    with torch.no_grad():
        for n in (0, 12):  # an empty cache, and a cache of three blocks
            ids = torch.randint(0, 256, (1, n + 4), generator=gen)
            eng._cache.reset()
            eng.model.prefill(ids[:, :n], eng._cache, 4)
            static = eng._static(ids[:, n:])[0]  # a warm-up, as capture's
            # What capture needs: the whole step runs without waiting for the device, and launches what it
            # launched at the other length, so that a graph captured at one replays at any.
            with HostSyncTrap(), LaunchRecorder(persistent) as step:
                again = eng._static.forward()[0]
            assert torch.equal(again, static)
            eng._static._load(ids[0, n:].tolist())
            with LaunchRecorder(persistent) as commit:
                eng._static.forward(commit=True)
            eng._cache.reset()  # undo the recorded commit: the one checked below runs through commit()
            eng.model.prefill(ids[:, :n], eng._cache, 4)
            recorded.append((step.launches, commit.launches))
            cache = ref.model.new_cache()
            ref.model.prefill(ids[:, :n], cache, 4)
            dynamic, _ = ref.model.step(ids[:, n:], cache)
            torch.testing.assert_close(static, dynamic[0], atol=1e-4, rtol=1e-4)
            # The captured commit: the block's keys and values land at the device-side length and the GDN
            # states advance as the reference commit's, and nothing past the block is written.
            before = [k.clone() for k in eng._cache.keys if k is not None]
            with HostSyncTrap():
                eng._static.commit(ids[0, n:].tolist())
            ref.model.commit(ids[:, n:], cache, 4)
            assert eng._cache.length == cache.length == n + 4
            for i in ref.model.config.attention_layers:
                for mine, theirs in ((eng._cache.keys[i], cache.keys[i]), (eng._cache.values[i], cache.values[i])):
                    torch.testing.assert_close(mine[:, :, : n + 4], theirs[:, :, : n + 4], atol=1e-4, rtol=1e-4)
            rest = [k[:, :, n + 4:] for k in eng._cache.keys if k is not None]
            assert all(torch.equal(a[:, :, n + 4:], b) for a, b in zip(before, rest, strict=True))
            for i in ref.model.config.gdn_layers:
                for mine, theirs in zip(eng._cache.gdn_state(i), cache.gdn_state(i), strict=True):
                    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    # Eagerly too, every step writes one logits buffer, as a graph replay does: a caller that kept the
    # previous step's logits would see them change here as on a GPU.
    first = eng._static([5, 6, 7, 8]).clone()
    kept = eng._static([5, 6, 7, 8])
    assert torch.equal(kept, first) and eng._static([9, 9, 9, 9]) is kept and not torch.equal(kept, first)
    for i, what in enumerate(("step", "commit")):
        assert recorded[0][i], what
        assert first_difference(recorded[0][i], recorded[1][i]) is None, (what, first_difference(
            recorded[0][i], recorded[1][i]))
    # The forced GEMV MoE path is the static step's alone: prefill and commit keep the shape-based choice.
    assert eng._static.experts and not any(e.graph_safe for e in eng._static.experts)
    assert "up to 64" in StaticStep.supported(eng.model, 65)  # longer blocks: the eager step
    prompt = [9, 8, 7, 6, 5]
    # The prompt's tail and 3 new tokens fill a block that the static commit writes, then the 4th is denoised
    # on top of it.
    kw = dict(max_new_tokens=4, steps_per_block=1)  # a step per block: the steps themselves are checked above
    assert eng.generate(prompt, **kw).token_ids == ref.generate(prompt, **kw).token_ids
    with pytest.raises(clover_lite.GenerationError, match="context"):
        eng.generate(prompt, max_new_tokens=100)


@pytest.mark.parametrize("arch, hidden, unverified", [("sm_90", 64, "0"), ("sm_86", 64, "0"), ("sm_90", 128, "1"),
                                                     ("sm_90", 128, "0")])
def test_kernels_at_a_gpus_table_configs_match_the_reference(request, tmp_path, monkeypatch, arch, hidden, unverified):
    """The interpreter otherwise runs one config per kernel; here every kernel takes what it would on the
    named GPU (tiles, split-K filling 132 SMs, the MoE GEMV's): a step of 4 tokens (GEMV paths) of the
    quantized model in fp32 over the cache of a 40-token prefill (GEMM, tiled MoE), against the torch path.
    Hidden size 128 in groups of 128: with CLOVER_KERNELS_UNVERIFIED=1 most linears and the experts in the MMA
    order, with its 128-row tiles; without it (the GPU-verified default) none.
    (Call 3's fp32 model check failed on an H200: this rules out the configs' logic, not the GPU's code.)"""
    from clover_lite.models.quantized import QuantLinear
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

    monkeypatch.setenv("CLOVER_KERNELS_UNVERIFIED", unverified)
    _as_on_gpu(monkeypatch, arch)
    src = request.getfixturevalue("tiny2_dir" if hidden == 64 else "tiny128_dir")
    q = quantize_model(src, tmp_path / "q", QuantizeOptions(group_size=hidden // 2 if hidden == 64 else 128,
                                                            nsamples=4, seqlen=32)).out
    ref, tri = _pair(q)
    repacked = [m for m in tri.model.modules() if isinstance(m, QuantLinear) and m.mma_order]
    assert bool(repacked) == (hidden == 128 and unverified == "1")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (1, 44), generator=gen)
    with torch.no_grad():
        steps = []
        for engine in (ref, tri):
            cache = engine.model.new_cache()
            engine.model.prefill(ids[:, :40], cache, 4)
            steps.append(engine.model.step(ids[:, 40:], cache)[0])
    torch.testing.assert_close(steps[1], steps[0], atol=1e-4, rtol=1e-4)
