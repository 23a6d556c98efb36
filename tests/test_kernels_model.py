"""A whole generation with every Triton kernel (attention, GDN, sampling; INT4 GEMM and MoE for a
quantized model), run by the interpreter, gives the reference path's greedy tokens."""

import pytest
import torch

pytest.importorskip("triton")

import clover_lite  # noqa: E402
from clover_lite.kernels import dispatch  # noqa: E402


def _pair(path):
    ref = clover_lite.load(path, device="cpu")
    tri = clover_lite.load(path, device="cpu")
    dispatch.apply(tri.model, "triton")
    return ref, tri


def test_float_model_kernels_match_reference(tiny_dir):
    ref, tri = _pair(tiny_dir)
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


def test_sampling_with_kernels_is_seeded(tiny_dir):
    _, tri = _pair(tiny_dir)
    kw = dict(max_new_tokens=6, temperature=1.0, seed=11)
    assert tri.generate([1, 2, 3], **kw).token_ids == tri.generate([1, 2, 3], **kw).token_ids
